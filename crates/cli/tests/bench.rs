//! `cherenkov bench` on a machine without a GPU: it says so before writing its store.

mod common;

use common::Home;

#[test]
fn bench_without_a_gpu_says_so_before_writing_its_store() {
    if cherenkov_cuda::gpu::driver_present() {
        // A real benchmark would run here; `tools/gpu/bench.sh` is the way to run one.
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let home = Home::new();
    let err = home.fails(&["bench", "--layers", "2", "--no-peer"]);
    assert!(err.contains("cherenkov bench measures on the GPU") && err.contains("no usable GPU"), "{err}");
    // Nothing of the synthetic store (a few GB at 2 layers) was written.
    assert!(!home.path().join("bench").exists(), "{err}");
}
