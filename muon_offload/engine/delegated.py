"""``Delegated``: an attribute of the optimizer that is one of its collaborators' own, so the
optimizer's public surface stays whole while the work lives with the part that holds it."""

from __future__ import annotations


class Delegated:
    """``timeline = Delegated("_tools", Tools.timeline)`` on the optimizer's class reads
    ``opt._tools.timeline``: a method comes bound to the collaborator, a property is read
    there. Assigned, it assigns the collaborator's (a property without a setter refuses, as
    the optimizer's own would). The class attribute keeps the member's docstring."""

    def __init__(self, part: str, member) -> None:
        self.part = part
        if isinstance(member, str):
            self.name = member
        else:
            self.name = (member.fget if isinstance(member, property) else member).__name__
            self.__doc__ = member.__doc__

    def __get__(self, opt, owner=None):
        if opt is None:
            return self
        return getattr(getattr(opt, self.part), self.name)

    def __set__(self, opt, value) -> None:
        setattr(getattr(opt, self.part), self.name, value)
