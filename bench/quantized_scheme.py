"""The measurement that chose 8-bit state's scheme (kernels/quant_maps.py), CPU only, ~10 min:
Adam / Lion / Muon state quantized blockwise after every step against fp32 state, for code
maps (linear, bitsandbytes' dynamic map, power 2 / 4), rounding (0: to nearest, 1:
stochastic) and block sizes. Gradients: log-normal per-element scales; from step T/3 half the
elements shrink 10x and every 8th of the other half stops (v must decay, m reach 0).

    python bench/quantized_scheme.py adam | lion | muon [256]   (256: block 256 only)
"""

# ruff: noqa
import torch, math, sys

torch.manual_seed(0)
GUARD = True


def dyn_map(signed):
    data = []
    nsb = 7
    for i in range(7):
        fi = 2**i + 1 if signed else 2 ** (i + 1) + 1
        b = torch.linspace(0.1, 1, fi)
        means = (b[:-1] + b[1:]) / 2
        data += (10 ** (-6 + i) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data.sort()
    return torch.tensor(data)


DYN_S, DYN_U = dyn_map(True), dyn_map(False)


def table_q(y, table, sr, gen):
    # y normalized in [-1,1]; value-space nearest / stochastic between neighbours
    hi = torch.searchsorted(table, y.contiguous()).clamp(1, len(table) - 1)
    lo = hi - 1
    a, b = table[lo], table[hi]
    t = ((y - a) / (b - a)).clamp(0, 1)
    if sr:
        u = torch.rand(y.shape, generator=gen)
        up = u < t
    else:
        up = t >= 0.5
    return table[torch.where(up, hi, lo)]


def pow_q(y, p, cmax, sr, gen):
    s = y.sign()
    a = y.abs()
    q = a ** (1 / p) * cmax
    if sr:
        c0 = q.floor()
        f0 = (c0 / cmax) ** p
        f1 = ((c0 + 1) / cmax) ** p
        t = ((a - f0) / (f1 - f0)).clamp(0, 1)
        c = c0 + (torch.rand(y.shape, generator=gen) < t).float()
    else:
        c = (q + 0.5).floor()
    return s * (c / cmax) ** p


def linear_q(y, cmax, sr, gen):
    q = y * cmax
    c = (q + torch.rand(y.shape, generator=gen)).floor() if sr else (q + 0.5).floor()
    return c / cmax


def qd(x, scheme, B, signed, gen):
    # quantize -> dequantize, blockwise absmax
    n = x.numel()
    xb = x.reshape(-1, B)
    am = xb.abs().amax(1, keepdim=True)
    y = torch.where(am > 0, xb / am, torch.zeros_like(xb))
    kind, sr = scheme
    TMIN = {
        "dyn": DYN_U[1].item(),
        "linear": 1 / 255,
        "pow4": (1 / 255) ** 4,
        "pow2": (1 / 255) ** 2,
    }[kind]
    cmax = 127 if signed else 255
    if kind == "fp32":
        return x.clone()
    if kind == "linear":
        r = linear_q(y, cmax, sr, gen)
    elif kind == "dyn":
        r = table_q(y, DYN_S if signed else DYN_U, sr, gen)
    elif kind.startswith("pow"):
        r = pow_q(y, int(kind[3:]), cmax, sr, gen)
    if not signed and GUARD:
        r = torch.where((xb > 0) & (r == 0), TMIN, r)
    return (r * am).reshape(n)


def grads(N, T, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(1.5 * torch.randn(N, generator=g))
    mean = 0.3 * torch.randn(N, generator=g)
    for t in range(T):
        s = scale.clone()
        if t >= T // 3:
            s[: N // 2] *= 0.1
            s[N // 2 :: 8] = 0  # some shrink, some stop (dead units)
        yield s * (mean + torch.randn(N, generator=g))


def run_adam(mscheme, vscheme, B, N=8192, T=450, b1=0.9, b2=0.999, eps=1e-8):
    gen = torch.Generator().manual_seed(1)
    m = torch.zeros(N)
    v = torch.zeros(N)
    m32 = torch.zeros(N)
    v32 = torch.zeros(N)
    out = []
    acc8 = torch.zeros(N)
    acc32 = torch.zeros(N)
    for t, g in enumerate(grads(N, T, 0), 1):
        m32.lerp_(g, 1 - b1)
        v32.mul_(b2).addcmul_(g, g, value=1 - b2)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1 = 1 - b1**t
        bc2 = 1 - b2**t
        u8 = (m / bc1) / ((v / bc2).sqrt() + eps)
        u32 = (m32 / bc1) / ((v32 / bc2).sqrt() + eps)
        acc8 += u8
        acc32 += u32
        if t in (100, T // 3 + 100, T):
            rel = ((u8 - u32).norm() / u32.norm()).item()
            dead = slice(N // 2, None, 8)
            out.append(
                f"   drift |sum du|/|sum u|={((acc8 - acc32).norm() / acc32.norm()).item():.4f} dead-unit |u8| mean={u8[dead].abs().mean().item():.2e} fp32 {u32[dead].abs().mean().item():.2e}"
            )
            vr = (v[: N // 2] / v32[: N // 2]).median().item()
            out.append(f"t={t}: |du|/|u|={rel:.4f} v8/v32(decaying half) med={vr:.3f}")
        m = qd(m, mscheme, B, True, gen)
        v = qd(v, vscheme, B, False, gen)
    return out


def run_mom(scheme, B, kind, N=8192, T=450):
    gen = torch.Generator().manual_seed(1)
    m = torch.zeros(N)
    m32 = torch.zeros(N)
    out = []
    for t, g in enumerate(grads(N, T, 0), 1):
        if kind == "muon":
            m32.mul_(0.95).add_(g)
            m.mul_(0.95).add_(g)
            a, b = m, m32
        else:  # lion beta1 .9 beta2 .99
            a = torch.lerp(m, g, 0.1).sign()
            b = torch.lerp(m32, g, 0.1).sign()
            m32.lerp_(g, 0.01)
            m.lerp_(g, 0.01)
        if t in (100, T // 3 + 100, T):
            dead = slice(N // 2, None, 8)  # gradient stopped at T // 3: momentum must decay
            stopped = f" stopped |m8| mean={m[dead].abs().mean().item():.2e} fp32 {m32[dead].abs().mean().item():.2e}"
            if kind == "muon":
                out.append(f"t={t}: |dM|/|M|={((a - b).norm() / b.norm()).item():.4f}" + stopped)
            else:
                out.append(
                    f"t={t}: sign agree={(a == b).float().mean().item():.4f} |dm|/|m|={((m - m32).norm() / m32.norm()).item():.4f} m8/m32 decaying half med={(m[: N // 2] / m32[: N // 2]).median().item():.3f}"
                    + stopped
                )
        m = qd(m, scheme, B, True, gen)
    return out


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "adam":
        for B in (256, 2048):
            for ms, vs in (
                [(("pow4", 0), ("pow4", 0)), (("pow4", 1), ("pow4", 1)), (("dyn", 0), ("dyn", 0))]
                if B == 256
                else []
            ):
                print(B, ms, vs, *run_adam(ms, vs, B), sep="\n   ", flush=True)
    else:
        for B in (256,) if len(sys.argv) > 2 else (256, 2048):
            for s in [("linear", 0), ("pow2", 0), ("pow2", 1)]:
                print(what, B, s, *run_mom(s, B, what), sep="\n   ", flush=True)
