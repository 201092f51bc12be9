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
