"""``Delegated``: an attribute of the optimizer that is one of its collaborators' own, so the
optimizer's public surface stays whole while the work lives with the part that holds it."""

from __future__ import annotations


class Delegated:
    """``timeline = Delegated("_tools", Tools.timeline)`` on the optimizer's class reads
    ``opt._tools.timeline``: a method comes bound to the collaborator, a property is read
    there. Assigned, it assigns the collaborator's (a property without a setter refuses, as
    the optimizer's own would; a method refuses too). The class attribute keeps the member's
    docstring."""

    def __init__(self, part: str, member, assigned: str = "") -> None:
        self.part = part
        self.assigned = assigned  # what to say when a method is assigned (the setting's way)
        if isinstance(member, str):
            self.name = member
        else:
            self.name = (member.fget if isinstance(member, property) else member).__name__
            self.__doc__ = member.__doc__

    def __set_name__(self, owner, name: str) -> None:
        self.attr = name  # the optimizer's name for it

    def __get__(self, opt, owner=None):
        if opt is None:
            return self
        return getattr(getattr(opt, self.part), self.name)

    def __set__(self, opt, value) -> None:
        part = getattr(opt, self.part)
        if callable(getattr(type(part), self.name, None)):  # a method: assigned, it would
            # shadow the method on the part and break what calls it (a backward hook)
            raise AttributeError(
                f"{type(opt).__name__}.{self.attr} is a method and cannot be assigned"
                + (f": {self.assigned}" if self.assigned else "")
            )
        setattr(part, self.name, value)
