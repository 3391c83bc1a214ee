//! The element types the CPU kernels read and write: f32, bfloat16 and IEEE half. Kernels load
//! every element to f32, compute in f32 and round once on the store, so one generic body serves
//! all three. Half types arrive from Python as the raw 16-bit patterns (numpy has no bfloat16).

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
}
