//! The element types the CPU kernels read and write: f32, bfloat16 and IEEE half, and for KV
//! caches only the two OCP 8-bit floats (e4m3fn, e5m2). Kernels load every element to f32, compute
//! in f32 and round once on the store, so one generic body serves all of them. Half types arrive
//! from Python as the raw 16-bit patterns (numpy has no bfloat16), 8-bit ones as uint8.

/// A storage element: `load` widens to f32 exactly, `store` rounds to nearest even (as torch's
/// own conversions do, so a kernel's output compares bit for bit with torch's casts).
pub trait Elem: Copy + Send + Sync + 'static {
    fn load(self) -> f32;
    fn store(x: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(x: f32) -> f32 {
        x
    }
}

/// bfloat16: the top half of an f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Elem for Bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    #[inline(always)]
    fn store(x: f32) -> Bf16 {
        let b = x.to_bits();
        let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
        // A select, not a branch, so the store loops still vectorise; torch's NaN is 0x7fc0. It is
        // built from `b` (a NaN's exponent bits, 0x7f80, and the quiet bit) rather than written as a
        // literal: with a literal LLVM folds the select into a merge-masked load of a constant
        // (`vmovdqu16 mem, zmm{k}`), which ran every bf16 store loop ~15x slower on Zen 4.
        let nan = (((b >> 16) & 0x7f80) | 0x40) as u16;
        Bf16(if x.is_nan() { nan } else { rounded })
    }
}

/// IEEE 754 binary16. Converted in software (exact both ways): half caches are rare on CPUs,
/// and the bit tricks below vectorise where F16C would need a separate code path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

impl Elem for F16 {
    #[inline(always)]
    fn load(self) -> f32 {
        // Move exponent and mantissa into place and rebias; subnormals are renormalised by one
        // float subtraction, infinities and NaNs get the f32 maximum exponent.
        let h = self.0 as u32;
        let shifted_exp = 0x7c00 << 13;
        let mut o = (h & 0x7fff) << 13;
        let exp = o & shifted_exp;
        o += (127 - 15) << 23;
        if exp == shifted_exp {
            o += (128 - 16) << 23;
        } else if exp == 0 {
            o += 1 << 23;
            o = (f32::from_bits(o) - f32::from_bits(113 << 23)).to_bits();
        }
        f32::from_bits(o | (h & 0x8000) << 16)
    }
    #[inline(always)]
    fn store(x: f32) -> F16 {
        let sign = (x.to_bits() >> 16) & 0x8000;
        let f = x.to_bits() & 0x7fff_ffff;
        let o = if f >= (127 + 16) << 23 {
            // Too large for a half (or Inf / NaN).
            if f > 0x7f80_0000 {
                0x7e00
            } else {
                0x7c00
            }
        } else if f < 113 << 23 {
            // A half subnormal or zero: adding a magic float lets the FPU do the rounding.
            let magic = ((127 - 15) + (23 - 10) + 1) << 23;
            (f32::from_bits(f) + f32::from_bits(magic)).to_bits() - magic
        } else {
            let odd = (f >> 13) & 1;
            // Rebias the exponent and round to nearest even in one add.
            f.wrapping_add(((15u32.wrapping_sub(127)) << 23).wrapping_add(0xfff) + odd) >> 13
        };
        F16((o | sign) as u16)
    }
}

/// A float of `1 + E + M` bits (bias `2^(E-1) - 1`) from `x`, rounded to nearest even, as a
/// code: the magnitude's code in the low bits, the sign in bit `E + M`. `max_code` is the largest
/// finite magnitude's code; above it `over` is returned (infinity, or the saturated maximum for a
/// format without one), and a NaN becomes `nan`. These are torch's conversions (a test checks
/// every code and ties against its casts).
#[inline(always)]
fn to_minifloat<const E: u32, const M: u32>(x: f32, max_code: u32, over: u32, nan: u32) -> u8 {
    let sign = (x.to_bits() >> 31) << (E + M);
    let a = x.abs();
    let bias = (1 << (E - 1)) - 1;
    let code = if a.is_nan() {
        nan
    } else if a < f32::from_bits((128 - bias) << 23) {
        // Below the smallest normal: the subnormal step is 2^(1 - bias - M), so the scaled value
        // rounded to an integer is the code (2^M, the smallest normal's code, included).
        (a * f32::from_bits((127 + bias + M - 1) << 23)).round_ties_even() as u32
    } else {
        let b = a.to_bits();
        let shift = 23 - M;
        let rounded = b + ((1 << (shift - 1)) - 1) + ((b >> shift) & 1);
        // `a` is finite here, so `rounded` still fits; the subtraction rebiases the exponent.
        let c = (rounded >> shift) - ((127 - bias) << M);
        if c > max_code {
            over
        } else {
            c
        }
    };
    (code | sign) as u8
}

/// OCP FP8 E4M3 ("fn": no infinities; 0x7f and 0xff are NaN, the largest finite value 448).
/// Stores saturate to +-448, as torch's cast does. (The decode kernels' vector loads read the two
/// NaN codes as +-480: `attention_x86::e4m3x16` says why.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

impl Elem for F8E4M3 {
    #[inline(always)]
    fn load(self) -> f32 {
        let m = self.0 & 0x7f;
        if m == 0x7f {
            return f32::NAN;
        }
        // The magnitude's bits placed as a half's (exponent one bit wider, bias 15 for 7): the
        // half's value times 2^8 is the e4m3 value, subnormals included.
        let h = ((m as u16) << 7) | ((self.0 as u16 & 0x80) << 8);
        F16(h).load() * 256.0
    }
    #[inline(always)]
    fn store(x: f32) -> F8E4M3 {
        F8E4M3(to_minifloat::<4, 3>(x, 0x7e, 0x7e, 0x7f))
    }
}

/// OCP FP8 E5M2: the top byte of an IEEE half (infinities and NaNs as a half's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F8E5M2(pub u8);

impl Elem for F8E5M2 {
    #[inline(always)]
    fn load(self) -> f32 {
        F16((self.0 as u16) << 8).load()
    }
    #[inline(always)]
    fn store(x: f32) -> F8E5M2 {
        F8E5M2(to_minifloat::<5, 2>(x, 0x7b, 0x7c, 0x7f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rounding() {
        for x in [0.0f32, -0.0, 1.0, -2.5, 3.0e38, 1.0e-40, f32::INFINITY] {
            let b = Bf16::store(x);
            assert_eq!(b.load().to_bits() >> 16, b.0 as u32, "{x}");
        }
        // 1 + 2^-8 lies exactly between two bf16 values: ties go to the even one (1.0).
        assert_eq!(Bf16::store(1.0 + 1.0 / 256.0).load(), 1.0);
        assert_eq!(Bf16::store(1.0 + 3.0 / 256.0).load(), 1.0 + 4.0 / 256.0);
        assert_eq!(Bf16::store(f32::NAN).0, 0x7fc0);
        for bits in [
            0xffc0_0000u32,
            0x7f80_0001,
            0xff80_0001,
            0x7fff_ffff,
            0xffff_ffff,
        ] {
            assert_eq!(Bf16::store(f32::from_bits(bits)).0, 0x7fc0, "{bits:#x}");
        }
    }

    #[test]
    fn f16_is_exact_on_every_half_value() {
        for bits in 0..=u16::MAX {
            let h = F16(bits);
            let x = h.load();
            if x.is_nan() {
                assert!(F16::store(x).load().is_nan());
                continue;
            }
            assert_eq!(F16::store(x), h, "bits {bits:#06x} -> {x}");
        }
        assert_eq!(F16(0x3c00).load(), 1.0);
        assert_eq!(F16(0x0001).load(), 2f32.powi(-24));
        assert_eq!(F16::store(65520.0).0, 0x7c00); // rounds up past the largest half
        assert_eq!(F16::store(1.0 + 1.0 / 2048.0).0, 0x3c00); // tie to even
        assert_eq!(F16::store(1.0 + 3.0 / 2048.0).0, 0x3c02);
        assert_eq!(F16::store(2f32.powi(-25)).0, 0); // tie to even at the bottom
        assert_eq!(F16::store(-1.0e-30).0, 0x8000);
    }

    #[test]
    fn fp8_codes_round_trip_and_round() {
        for bits in 0..=u8::MAX {
            let (a, b) = (F8E4M3(bits), F8E5M2(bits));
            let (x, y) = (a.load(), b.load());
            if x.is_nan() {
                assert_eq!(bits & 0x7f, 0x7f);
            } else {
                assert_eq!(F8E4M3::store(x), a, "e4m3 {bits:#04x} -> {x}");
            }
            if y.is_nan() {
                assert!(F8E5M2::store(y).load().is_nan());
            } else {
                assert_eq!(F8E5M2::store(y), b, "e5m2 {bits:#04x} -> {y}");
            }
        }
        assert_eq!(F8E4M3(0x38).load(), 1.0);
        assert_eq!(F8E4M3(0x7e).load(), 448.0);
        assert_eq!(F8E4M3(0x01).load(), 2f32.powi(-9));
        assert_eq!(F8E4M3::store(1.0e6), F8E4M3(0x7e)); // saturates
        assert_eq!(F8E4M3::store(-464.0), F8E4M3(0xfe)); // the tie above 448 too
        assert_eq!(F8E4M3::store(1.0 + 1.0 / 16.0), F8E4M3(0x38)); // tie to even
        assert_eq!(F8E4M3::store(1.0 + 3.0 / 16.0), F8E4M3(0x3a));
        assert_eq!(F8E4M3::store(2f32.powi(-10)), F8E4M3(0)); // tie to even at the bottom
        assert_eq!(F8E5M2(0x3c).load(), 1.0);
        assert_eq!(F8E5M2::store(57344.0), F8E5M2(0x7b));
        assert_eq!(F8E5M2::store(61440.0), F8E5M2(0x7c)); // the tie past the largest: infinity
        assert_eq!(F8E5M2::store(-1.0e6), F8E5M2(0xfc));
        assert_eq!(F8E5M2::store(1.0 + 1.0 / 8.0), F8E5M2(0x3c));
        assert_eq!(F8E5M2::store(1.0 + 3.0 / 8.0), F8E5M2(0x3e));
    }
}
