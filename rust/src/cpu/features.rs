//! What this CPU can do, in one place: the SIMD kernels dispatch on it and Python reads it
//! (through `cpu_features()`) to choose the default dtype.

/// The features, in Linux `/proc/cpuinfo` spelling, that this CPU has and the OS enables.
pub fn cpu_features() -> Vec<&'static str> {
    let mut found = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($rust:tt => $name:expr),* $(,)?) => {
                $(if std::is_x86_feature_detected!($rust) {
                    found.push($name);
                })*
            };
        }
        probe!(
            "avx2" => "avx2",
            "fma" => "fma",
            "f16c" => "f16c",
            "avx512f" => "avx512f",
            "avx512bw" => "avx512bw",
            "avx512vnni" => "avx512_vnni",
            "avx512bf16" => "avx512_bf16",
            "avx512fp16" => "avx512_fp16",
        );
        found.extend(amx());
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("bf16") {
            found.push("bf16");
        }
    }
    found
}

/// AMX tiles: CPUID leaf 7 says the CPU has them, XCR0 bits 17-18 that the OS saves their
/// state (std's feature detection does not cover AMX on stable Rust).
#[cfg(target_arch = "x86_64")]
fn amx() -> Vec<&'static str> {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // CPUID exists on every x86-64 CPU; leaf 7 is only read when the CPU reports it.
    if __cpuid(0).eax < 7 {
        return Vec::new();
    }
    let leaf7 = __cpuid_count(7, 0);
    if !std::is_x86_feature_detected!("xsave") || !os_saves_amx() {
        return Vec::new();
    }
    let bits = [(22, "amx_bf16"), (24, "amx_tile"), (25, "amx_int8")];
    bits.iter()
        .filter(|(bit, _)| leaf7.edx >> bit & 1 == 1)
        .map(|&(_, name)| name)
        .collect()
}

#[cfg(target_arch = "x86_64")]
fn os_saves_amx() -> bool {
    #[target_feature(enable = "xsave")]
    unsafe fn xcr0() -> u64 {
        std::arch::x86_64::_xgetbv(0)
    }
    // SAFETY: called only after checking the CPU supports XSAVE (hence XGETBV).
    let xcr0 = unsafe { xcr0() };
    xcr0 & (0b11 << 17) == 0b11 << 17
}

#[cfg(test)]
mod tests {
    #[test]
    fn agrees_with_proc_cpuinfo() {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let Some(flags) = info.lines().find(|l| l.starts_with("flags")) else {
            return;
        };
        let flags: Vec<&str> = flags.split_whitespace().collect();
        for f in super::cpu_features() {
            assert!(flags.contains(&f), "{f} detected but not in /proc/cpuinfo");
        }
    }
}
