#!/usr/bin/env python3
"""Fits the polynomial of kernels/normal_cdf.h and reports its error over the bf16 inputs 0 to 16.

The standard normal's lower tail Phi(-|x|) = erfc(|x| / sqrt 2) / 2 is written
    Phi(-|x|) = exp(-x^2 / 2) * t * P(t),   t = 1 / (1 + A |x|),
where P is smooth on t in [0, 1] (P(0) = A / sqrt(2 pi), the tail's asymptote). This script fits P
by Chebyshev interpolation (mpmath.chebyfit), rounds its coefficients to float, and evaluates the
formula the way the kernels do in float (each product and fma rounded, the exponent x^2 * c
rounded) over every non-negative bf16 value up to 16 (past ~13.2 the GPU's exp2 flushes the tail
to zero), against the exact tail: the relative error
of Phi(-|x|) and of Phi(|x|) = 1 - Phi(-|x|). The GPU's reciprocal and exp2 approximations add up
to ~2 ulp more (tests/test_kernels.cpp measures the kernels themselves).

Usage: python3 tools/fit_normal_cdf.py [A] [coefficients]     (defaults 0.4 10; needs mpmath:
Debian python3-mpmath). Prints the coefficients, highest degree first, as C float literals.
"""
import math
import struct
import sys

import mpmath as mp

mp.mp.dps = 30


def f32(v):
    return struct.unpack("f", struct.pack("f", float(v)))[0]


def tail(x):  # Phi(-x), exact
    return mp.erfc(mp.mpf(x) / mp.sqrt(2)) / 2


def main():
    a = float(sys.argv[1]) if len(sys.argv) > 1 else 0.4
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10

    def p_exact(t):
        t = mp.mpf(t)
        if t == 0:
            return a / mp.sqrt(2 * mp.pi)
        x = (1 / t - 1) / a
        return tail(x) * mp.exp(x * x / 2) / t

    poly, fit_error = mp.chebyfit(p_exact, [0, 1], n, error=True)
    coef = [f32(c) for c in poly]
    c_exp = f32(-0.5 / math.log(2))  # exp(-x^2/2) = exp2(x^2 * c_exp)

    def tail_f32(x):
        t = f32(1.0 / f32(1.0 + f32(a) * x))
        p = coef[0]
        for c in coef[1:]:
            p = f32(p * t + c)
        arg = f32(f32(x * x) * c_exp)
        gauss = f32(2.0**arg) if arg >= -126 else 0.0  # the GPU's exp2 flushes denormals
        return f32(gauss * f32(t * p))

    worst = {"tail, |x| < 4": 0.0, "tail, |x| < 13": 0.0, "1 - tail": 0.0}
    for bits in range(0, 0x4180):  # bf16 bit patterns of 0 .. 16
        x = struct.unpack("f", struct.pack("I", bits << 16))[0]
        got, exact = tail_f32(x), float(tail(x))
        if exact > 1e-37:
            err = abs(got - exact) / exact
            worst["tail, |x| < 13"] = max(worst["tail, |x| < 13"], err)
            if x < 4:
                worst["tail, |x| < 4"] = max(worst["tail, |x| < 4"], err)
        worst["1 - tail"] = max(worst["1 - tail"], abs(f32(1 - got) - (1 - exact)) / (1 - exact))
    print(f"A = {a}, {n} coefficients: Chebyshev fit error {float(fit_error):.2e} (absolute, on P)")
    for k, v in worst.items():
        print(f"  float evaluation, largest relative error of {k}: {v:.2e}")
    print("  coefficients, highest degree first:")
    print("  " + ", ".join(f"{c:.9e}f" for c in coef))


if __name__ == "__main__":
    main()
