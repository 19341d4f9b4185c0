"""Independent float64 re-derivations of the update rules, written from the papers and from
dion's and torch's documented formulas, for the tests to compare against. Not used by the
package."""

import math

import torch

POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
NEWTON_SCHULZ5 = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def orthogonalize64(u, method="polar_express", eps=1e-8):
    """One matrix, float64 throughout."""
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    coeffs, scale = (POLAR_EXPRESS, 1.02) if method == "polar_express" else (NEWTON_SCHULZ5, 1.0)
    x = x / (torch.linalg.matrix_norm(x) * scale + eps)
    for a, b, c in coeffs:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_step64(
    x, g, m, *, lr, mu, wd, nesterov, adjust_lr, flatten=False, method="polar_express", eps=1e-8
):
    """Returns (new x, new momentum) in float64 for one muon parameter."""
    x, g, m = x.double(), g.double(), m.double()
    m = mu * m + g
    u = mu * m + g if nesterov else m
    if flatten:
        mats = [u.reshape(u.shape[0], -1)]
        fan_out, fan_in = mats[0].shape
    else:
        mats = list(u.reshape(-1, *u.shape[-2:]))
        fan_out, fan_in = u.shape[-2:]
    o = torch.stack([orthogonalize64(a, method, eps) for a in mats]).reshape(u.shape)
    if adjust_lr == "spectral_norm":
        alr = lr * math.sqrt(fan_out / fan_in)
    elif adjust_lr == "rms_norm":
        alr = lr * 0.2 * math.sqrt(max(fan_out, fan_in))
    else:
        alr = lr
    return x * (1 - lr * wd) - alr * o, m


def adamw_step64(x, g, m, v, *, lr, beta1, beta2, eps, wd, step):
    x, g, m, v = x.double(), g.double(), m.double(), v.double()
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1**step)
    v_hat = v / (1 - beta2**step)
    return x * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps), m, v


def lion_step64(x, g, m, *, lr, beta1, beta2, wd):
    x, g, m = x.double(), g.double(), m.double()
    u = torch.sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g
    return x * (1 - lr * wd) - lr * u, m


def orthogonalize64_batch(u, epsilon=1e-8):
    """An orthogonalizer both optimizers accept (dion's ``newton_schulz_func`` signature):
    Polar Express in float64 on each matrix of a batch, returned in float32. With it, two
    implementations differ only by fp32 rounding, so they can be compared tightly."""
    eps = float(epsilon)
    flat = u.reshape(-1, *u.shape[-2:])
    if flat.shape[0] == 0 or u.numel() == 0:  # dion hands over empty batches of empty shards
        return u.float()
    out = torch.stack([orthogonalize64(m, "polar_express", eps) for m in flat])
    return out.reshape(u.shape).float()
