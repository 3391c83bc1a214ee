//! MXFP4 ([`QKind::Mx4`](super::QKind::Mx4), gpt-oss's experts): per 32 weights one E8M0
//! exponent byte `e` and 32 E2M1 codes, `w = e2m1(code) · 2^(e - 127)`.
//!
//! Twice an E2M1 value is a small integer (0, 1, 2, 3, 4, 6, 8, 12 and negatives), so
//! `w = (2 e2m1) · 2^(e - 128)`. The kernels look the 4-bit codes up in [`LUT`], which adds 12
//! to make them unsigned (0..=24, what `vpmaddubsw` / `vpdpbusd` take), and the block's min
//! is the implied `-12 · scale`: the Q4_0 scheme with a table in front, so the blocks stay at 4
//! bits and every product is exact; the only rounding is the activations' int8 quantization.
//! A packed block stores the codes as Q4 does its nibbles and one E8M0 byte per row (4.25 bits a
//! weight), decoded by [`e8m0_half`] (scalar) or its SIMD copy in `x86.rs`.

/// E2M1 code → `2 · value + 12` (code 8 is -0, the same 12 as code 0).
pub(crate) const LUT: [u8; 16] = [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0];

/// The offset [`LUT`] adds: a block's min is `-OFFSET · scale`.
pub(crate) const OFFSET: f32 = 12.0;

/// `2^(e - 128)` exactly, for every byte (ggml's `ggml_e8m0_to_fp32_half`; 2^-128 and 2^-127
/// are f32 subnormals). As the product of two normal powers `2^(⌈e/2⌉ - 64) · 2^(⌊e/2⌋ - 64)`,
/// which is exact and needs no branch, so the SIMD copy is the same few integer ops.
#[inline(always)]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let (hi, lo) = ((e as u32).div_ceil(2), e as u32 / 2);
    f32::from_bits((hi + 63) << 23) * f32::from_bits((lo + 63) << 23)
}

/// The byte `e` with `e8m0_half(e) == s` (bit for bit), if any.
pub(crate) fn e8m0_of(s: f32) -> Option<u8> {
    let bits = s.to_bits();
    let e = match bits {
        0x0020_0000 => 0,
        0x0040_0000 => 1,
        // A normal power of two 2^(E - 127) (mantissa 0) is e = E + 1.
        b if b & 0x807F_FFFF == 0 && b >> 23 >= 1 && b >> 23 <= 254 => (b >> 23) + 1,
        _ => return None,
    };
    Some(e as u8)
}

/// The code whose [`LUT`] entry is `u`, if any (12 → code 0, never -0's code 8).
pub(crate) fn code_of(u: u8) -> Option<u8> {
    LUT.iter().position(|&v| v == u).map(|c| c as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_is_every_power_from_2_pow_minus_128() {
        for e in 0..=255u8 {
            let want = 2f64.powi(e as i32 - 128);
            assert_eq!(e8m0_half(e) as f64, want, "e = {e}");
            assert_eq!(e8m0_of(e8m0_half(e)), Some(e));
        }
        for s in [
            0.0f32,
            -1.0,
            3.0,
            1.5,
            f32::NAN,
            f32::INFINITY,
            2f32.powi(-129),
        ] {
            assert_eq!(e8m0_of(s), None, "{s}");
        }
    }

    #[test]
    fn lut_is_twice_e2m1_plus_the_offset() {
        // E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (0, 0.5).
        for code in 0..16u8 {
            let (sign, exp, man) = (code >> 3, (code >> 1) & 3, (code & 1) as f64);
            let mag = if exp == 0 {
                man * 0.5
            } else {
                (1.0 + man / 2.0) * 2f64.powi(exp as i32 - 1)
            };
            let v = if sign == 1 { -mag } else { mag };
            assert_eq!(
                LUT[code as usize] as f64 - OFFSET as f64,
                2.0 * v,
                "code {code}"
            );
            let back = code_of(LUT[code as usize]).unwrap();
            assert_eq!(LUT[back as usize], LUT[code as usize]);
        }
        assert_eq!(code_of(5), None);
    }
}
