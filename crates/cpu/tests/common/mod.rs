//! Helpers shared by the CPU backend's integration tests: the golden fixtures packed once per test
//! process, and a model over them.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use cherenkov_cpu::CpuModel;
use cherenkov_engine::residency::{ExpertPool, HostSlots};
use cherenkov_model::checkpoint::Checkpoint;
use cherenkov_model::store::{Store, pack::pack};

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden")
}

/// Packs each fixture checkpoint once per test process.
pub fn store(variant: &str) -> Arc<Store> {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    static LOCK: Mutex<()> = Mutex::new(());
    let dir = DIR.get_or_init(|| tempfile::tempdir().unwrap());
    let _g = LOCK.lock().unwrap();
    let out = dir.path().join(variant.replace('/', "-"));
    if !out.join("manifest.json").exists() {
        let ck = Checkpoint::open(&fixtures().join(variant)).unwrap();
        pack(&ck, &out, &indicatif::ProgressBar::hidden()).unwrap();
    }
    Arc::new(Store::open(&out).unwrap())
}

pub fn model(store: Arc<Store>, slots: usize) -> CpuModel {
    let memory = Arc::new(HostSlots::new(slots, store.record_bytes()).unwrap());
    let pool = Arc::new(ExpertPool::new(store.clone(), memory, 2).unwrap());
    CpuModel::new(store, pool).unwrap()
}
