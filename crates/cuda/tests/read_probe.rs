//! Where an expert load's read time goes on this host (a measurement, not a check; ignored by
//! default). It needs no GPU, only a packed store whose expert file is in the page cache (the bench
//! store after `tools/gpu/bench.sh` on the GPU machine):
//!
//!     cargo test --release -p cherenkov-cuda --test read_probe --no-run   # prints the binary
//!     CHERENKOV_PROBE_STORE=<store dir> <binary> --ignored --nocapture
//!
//! It times, per record or piece (median over many records of the store's first layer): the
//! positioned read alone, the read through a bounce buffer with the piece checksum, the checksum and
//! the non-temporal copy alone on cache-hot data, and `stage_record` (the loader's whole read) with
//! 1, 2, 4 and 8 loads at once.

use std::time::{Duration, Instant};

use cherenkov_cuda::slots::{copy_streaming, stage_record};
use cherenkov_engine::residency::StoreRecord as Rec;
use cherenkov_model::store::Store;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn report(what: &str, d: Duration, bytes: usize) {
    let ms = d.as_secs_f64() * 1e3;
    println!("{what:70} {ms:8.4} ms  {:6.1} GB/s", bytes as f64 / d.as_secs_f64() / 1e9);
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn read_probe() {
    let dir = std::env::var("CHERENKOV_PROBE_STORE").expect("set CHERENKOV_PROBE_STORE to a packed store");
    let store = Store::open(std::path::Path::new(&dir)).unwrap();
    let rb = store.record_bytes();
    let piece = store.expert_piece_bytes().expect("a store with piece checksums");
    let experts = store.manifest.experts.num_experts.min(256);
    let mut buf = vec![0u8; rb];
    // Warm the page cache with every record used below.
    for e in 0..experts {
        store.read_expert(0, e, &mut buf).unwrap();
    }
    println!(
        "# read probe: records of {rb} bytes, pieces of {piece}, {experts} records of layer 0, rayon threads {}",
        rayon::current_num_threads()
    );

    let times = |f: &mut dyn FnMut(usize)| {
        median(
            (0..experts)
                .map(|e| {
                    let t = Instant::now();
                    f(e);
                    t.elapsed()
                })
                .collect(),
        )
    };

    report(
        "pread of a whole record, one thread",
        times(&mut |e| store.read_expert_range(0, e, 0, &mut buf).unwrap()),
        rb,
    );
    let mut pbuf = vec![0u8; piece];
    report(
        "pread of one piece, one thread",
        times(&mut |e| store.read_expert_range(0, e, 0, &mut pbuf).unwrap()),
        piece,
    );
    let mut bounce = vec![0u8; 256 << 10];
    report(
        "pread of one piece through a 256 KiB bounce buffer + checksum",
        times(&mut |e| store.read_expert_piece_chunked(0, e, 0, &mut bounce, &mut |_, _| ()).unwrap()),
        piece,
    );
    report(
        "the same + non-temporal copy into a record buffer",
        times(&mut |e| {
            store
                .read_expert_piece_chunked(0, e, 0, &mut bounce, &mut |at, b| {
                    copy_streaming(&mut buf[at..at + b.len()], b)
                })
                .unwrap()
        }),
        piece,
    );
    report(
        "xxh3 of a cache-hot 256 KiB buffer",
        times(&mut |_| {
            std::hint::black_box(twox_hash::XxHash3_64::oneshot(&bounce));
        }),
        bounce.len(),
    );
    let mut dst = vec![0u8; bounce.len()];
    report(
        "non-temporal copy of a cache-hot 256 KiB buffer",
        times(&mut |_| copy_streaming(&mut dst, &bounce)),
        bounce.len(),
    );
    report("ordinary copy of a cache-hot 256 KiB buffer", times(&mut |_| dst.copy_from_slice(&bounce)), bounce.len());
    report(
        "stage_record (pieces in parallel), one load at a time",
        times(&mut |e| stage_record(&Rec { store: &store, layer: 0, expert: e }, &mut buf).unwrap()),
        rb,
    );
    for loads in [2usize, 4, 8] {
        let mut bufs: Vec<Vec<u8>> = (0..loads).map(|_| vec![0u8; rb]).collect();
        let per: Vec<Duration> = std::thread::scope(|s| {
            let hs: Vec<_> = bufs
                .iter_mut()
                .enumerate()
                .map(|(t, b)| {
                    let store = &store;
                    s.spawn(move || {
                        (t..experts)
                            .step_by(loads)
                            .map(|e| {
                                let st = Instant::now();
                                stage_record(&Rec { store, layer: 0, expert: e }, b).unwrap();
                                st.elapsed()
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        report(&format!("stage_record, {loads} loads at once (per load)"), median(per), rb);
    }
}
