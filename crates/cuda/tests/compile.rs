//! Every kernel compiles (NVRTC, no GPU needed). CI installs NVRTC from the nvidia-cuda-nvrtc wheel
//! and sets CHERENKOV_REQUIRE_NVRTC=1, so there a missing NVRTC fails the test instead of skipping it.

#[test]
fn kernels_compile_for_hopper() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        assert!(
            std::env::var("CHERENKOV_REQUIRE_NVRTC").is_err(),
            "CHERENKOV_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("skipped: NVRTC not found (set LD_LIBRARY_PATH to a CUDA 13 lib directory to run this test)");
        return;
    }
    let ptx = cherenkov_cuda::compile::compile("sm_90").unwrap_or_else(|e| panic!("{e:#}"));
    assert!(ptx.contains(".target sm_90"), "PTX is not for sm_90");
}

/// Every kernel waits for its predecessor (`griddepcontrol.wait`) on Hopper, where the backend
/// launches them with programmatic stream serialization: a kernel without the wait could read its
/// inputs before the kernel that writes them has finished. On Ampere the instructions compile away.
#[test]
fn every_kernel_waits_for_its_predecessor() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    let ptx = cherenkov_cuda::compile::compile("sm_90").unwrap_or_else(|e| panic!("{e:#}"));
    let mut entries = 0;
    for body in ptx.split(".entry ").skip(1) {
        let name = body.split('(').next().unwrap_or("?");
        let end = body.find(".entry ").unwrap_or(body.len());
        assert!(body[..end].contains("griddepcontrol.wait"), "kernel {name} never calls grid_wait()");
        entries += 1;
    }
    assert_eq!(entries, cherenkov_cuda::compile::KERNELS.len(), "kernel entries in the PTX");
    let ampere = cherenkov_cuda::compile::compile("sm_80").unwrap_or_else(|e| panic!("{e:#}"));
    assert!(!ampere.contains("griddepcontrol"), "sm_80 has no programmatic dependent launch");
}

/// With `TIMELINE` (the kernel timeline, `CHERENKOV_TIMELINE`) every kernel records its blocks: each
/// opens with `KSPAN`, so each reads the global clock and the recording switch; without it none does.
#[test]
fn every_kernel_records_its_blocks_on_the_timeline() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    let ptx = cherenkov_cuda::compile::compile_with("sm_90", &["TIMELINE"]).unwrap_or_else(|e| panic!("{e:#}"));
    let mut entries = 0;
    for body in ptx.split(".entry ").skip(1) {
        let name = body.split('(').next().unwrap_or("?");
        let end = body.find(".entry ").unwrap_or(body.len());
        let body = &body[..end];
        assert!(body.contains("%globaltimer") && body.contains("tl_on"), "kernel {name} does not open with KSPAN");
        entries += 1;
    }
    assert_eq!(entries, cherenkov_cuda::compile::KERNELS.len(), "kernel entries in the PTX");
    let plain = cherenkov_cuda::compile::compile("sm_90").unwrap_or_else(|e| panic!("{e:#}"));
    assert!(!plain.contains("tl_on"), "the timeline is compiled only with TIMELINE");
}

/// The kernels' measurement variants (`CHERENKOV_KERNEL_DEFINES`, benchmark/notes-cuda.md): the
/// names a kernel tests with `#ifdef`/`#ifndef` and does not define itself. Each session's A/Bs
/// compile them on the GPU machine, where a variant that no longer compiles costs device time.
const VARIANTS: &[&str] = &[
    "ATTEND_ALL_SPLITS",
    "ATTEND_V_LATE",
    "COMBINE_LATE",
    "EXPERT_DOWN_LATE",
    "GATE_UP_STAGE_LATE",
    "GDN_TAIL_LATE",
    "HC_NO_PRELOAD",
    "MV_FLOAT_STREAMS",
    "MV_INT_NORM",
    "MV_L2_PASS",
    "MV_NO_DP4A",
    "MV_PROBE_NO_MATH",
    "MV_PROBE_NO_STAGE",
    "MV_STAGE_SERIAL",
    "MV_SUM_SERIAL",
    "ROUTE_MAP_LATE",
    "ROUTE_PACK_PREFIX",
];

/// Names a kernel source tests with `#ifdef`, `#ifndef` or `#if defined(..)`, less those it defines
/// itself (tunables with a default, such as `ATTEND_MERGE`) and those the compiler or the backend set.
fn tested_names() -> std::collections::BTreeSet<String> {
    let mut tested = std::collections::BTreeSet::new();
    let mut defined = std::collections::BTreeSet::new();
    for (_, text) in cherenkov_cuda::compile::SOURCES {
        for line in text.lines().map(str::trim) {
            let name = |rest: &str| {
                rest.trim_start_matches(|c: char| c == '(' || c.is_whitespace())
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .next()
                    .unwrap_or("")
                    .to_string()
            };
            if let Some(rest) = line.strip_prefix("#ifdef ").or_else(|| line.strip_prefix("#ifndef ")) {
                tested.insert(name(rest));
            } else if let Some(rest) = line.strip_prefix("#if defined") {
                tested.insert(name(rest));
            } else if let Some(rest) = line.strip_prefix("#define ") {
                defined.insert(name(rest));
            }
        }
    }
    tested.retain(|n| !defined.contains(n) && !n.starts_with("__") && n != "TIMELINE");
    tested
}

#[test]
fn the_variant_list_names_every_variant_the_kernels_test() {
    let tested = tested_names();
    let listed: std::collections::BTreeSet<String> = VARIANTS.iter().map(|s| s.to_string()).collect();
    assert!(!tested.is_empty(), "no #ifdef found in the kernel sources");
    let missing: Vec<_> = tested.difference(&listed).collect();
    let stale: Vec<_> = listed.difference(&tested).collect();
    assert!(missing.is_empty(), "variants tested in the kernels but not in VARIANTS: {missing:?}");
    assert!(stale.is_empty(), "VARIANTS names no kernel tests any more: {stale:?}");
}

/// Every measurement variant compiles, with the timeline and a moved mark: all of them in one
/// program (they touch different kernels or different places of one), and `MV_NO_DP4A` once more
/// alone, since it takes the tiled core off the integer path that the others' variants sit on.
#[test]
fn every_measurement_variant_compiles() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    let mut all: Vec<&str> = VARIANTS.iter().copied().filter(|v| *v != "MV_NO_DP4A").collect();
    all.extend(["TIMELINE", "TL_MARK_AT=2", "ATTEND_MERGE=1", "ROUTE_SUM_BATCH=8"]);
    for defines in [all, vec!["MV_NO_DP4A", "MV_PROBE_NO_MATH"]] {
        let ptx = cherenkov_cuda::compile::compile_with("sm_90", &defines)
            .unwrap_or_else(|e| panic!("with {defines:?}: {e:#}"));
        assert!(ptx.contains(".target sm_90"), "PTX is not for sm_90");
    }
}
