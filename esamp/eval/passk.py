"""Pass@k: the chance that at least one of k samples, drawn without replacement from the n a
problem has, is correct, given that c of the n are correct.

    pass@k = 1 - C(n - c, k) / C(n, k)

This is unbiased for the true pass@k of a model that solves the problem with some probability p
(Chen et al. 2021). It is computed as a running product so that large n does not overflow:

    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)
"""

from __future__ import annotations

from collections.abc import Iterable

from esamp.errors import ConfigError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct out of ``n`` samples."""
    if not (0 <= c <= n):
        raise ConfigError(f"correct count {c} is outside 0..{n}", hint="c must be between 0 and n")
    if not (1 <= k <= n):
        raise ConfigError(f"k={k} is outside 1..{n}", hint=f"choose k between 1 and n={n}")
    if n - c < k:  # every draw of k samples contains a correct one
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def parse_ks(text: str | Iterable[int], n: int) -> list[int]:
    """Turn ``"1,4,8"`` into ``[1, 4, 8]``, checking every k is in 1..n."""
    if isinstance(text, str):
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            ks = [int(p) for p in parts]
        except ValueError:
            raise ConfigError(
                f"-k {text!r} is not a comma-separated list of integers", hint="write it like -k 1,4,8"
            ) from None
    else:
        ks = [int(k) for k in text]
    if not ks:
        raise ConfigError("-k is empty", hint="write it like -k 1,4,8")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ConfigError(
            f"k={bad[0]} is outside 1..n with n={n}", hint=f"every k must be at most the number of samples -n ({n})"
        )
    return sorted(set(ks))
