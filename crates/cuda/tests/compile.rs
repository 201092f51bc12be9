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
    "GDN_ROWS_LATE",
    "GDN_TAIL_LATE",
    "HC_EARLY_RELEASE",
    "HC_NO_PRELOAD",
    "MV_FLOAT_STREAMS",
    "MV_IDLE_WAIT",
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

/// No kernel spills registers to local memory on Hopper: the kernels are compiled as the engine
/// compiles them (NVRTC for sm_90), then by `ptxas -v`, whose report names each kernel's spills. A
/// spill costs a hot kernel its speed without changing a result, so no other test would see it
/// (session 31: a second instantiation of the tiled core made `expert_down_q4` spill 76 bytes).
/// `CHERENKOV_PTXAS` names the ptxas binary (tools/test takes the one of the pinned
/// nvidia-cuda-nvcc wheel and sets `CHERENKOV_REQUIRE_PTXAS=1`, so there a missing one fails).
/// `CHERENKOV_PTXAS_REPORT=FILE` also writes ptxas's report there.
#[test]
fn no_kernel_spills_registers_on_hopper() {
    let ptxas = std::env::var_os("CHERENKOV_PTXAS").map(std::path::PathBuf::from).filter(|p| p.is_file());
    let required = std::env::var("CHERENKOV_REQUIRE_PTXAS").is_ok();
    let (Some(ptxas), true) = (ptxas, cherenkov_cuda::compile::nvrtc_available()) else {
        assert!(!required, "CHERENKOV_REQUIRE_PTXAS is set but CHERENKOV_PTXAS names no file, or NVRTC is missing");
        eprintln!("skipped: set CHERENKOV_PTXAS to a CUDA 13.0 ptxas (and NVRTC on LD_LIBRARY_PATH) to run this test");
        return;
    };
    let ptx = cherenkov_cuda::compile::compile("sm_90").unwrap_or_else(|e| panic!("{e:#}"));
    let dir = tempfile::tempdir().unwrap();
    let (src, out) = (dir.path().join("kernels.ptx"), dir.path().join("kernels.cubin"));
    std::fs::write(&src, ptx).unwrap();
    let run = std::process::Command::new(&ptxas)
        .args(["-arch=sm_90", "-v", "-o"])
        .arg(&out)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", ptxas.display()));
    let report = String::from_utf8_lossy(&run.stderr);
    // `CHERENKOV_PTXAS_REPORT=FILE` keeps the whole report (every kernel's registers and shared
    // memory), for reading a kernel's resources without a GPU.
    if let Some(path) = std::env::var_os("CHERENKOV_PTXAS_REPORT") {
        std::fs::write(&path, report.as_bytes()).unwrap_or_else(|e| panic!("cannot write the ptxas report: {e}"));
    }
    assert!(run.status.success(), "ptxas failed:\n{report}");
    let spills = spilling_kernels(&report);
    let kernels = report.matches("Compiling entry function").count();
    assert_eq!(kernels, cherenkov_cuda::compile::KERNELS.len(), "kernels in ptxas's report:\n{report}");
    assert!(spills.is_empty(), "kernels that spill registers on sm_90: {spills:?}");
}

/// The kernels a `ptxas -v` report shows spilling, with the report's line.
fn spilling_kernels(report: &str) -> Vec<(String, String)> {
    let mut kernel = String::new();
    let mut spills = Vec::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            kernel = rest.split('\'').next().unwrap_or("?").to_string();
        } else if line.contains("bytes spill stores") && !line.contains(" 0 bytes spill stores, 0 bytes spill loads") {
            spills.push((kernel.clone(), line.trim().to_string()));
        }
    }
    spills
}

#[test]
fn a_ptxas_report_with_a_spill_names_its_kernel() {
    let report = "ptxas info    : Compiling entry function 'a' for 'sm_90'\n\
                  ptxas info    : Function properties for a\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                  ptxas info    : Compiling entry function 'b' for 'sm_90'\n\
                  ptxas info    : Function properties for b\n    24 bytes stack frame, 76 bytes spill stores, 52 bytes spill loads\n";
    let spills = spilling_kernels(report);
    assert_eq!(spills.len(), 1, "{spills:?}");
    assert_eq!(spills[0].0, "b");
    assert!(spills[0].1.contains("76 bytes spill stores"));
}
