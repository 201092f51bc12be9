//! Can the expert kernels read a missing record over the bus themselves, at the link's rate? A
//! measurement for a streamed block without the copy engine between its router and its experts
//! (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test bus_expert_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! `zero_copy_probe` read records over the bus with a kernel that only loads and stores them
//! (44-49 GB/s). Here the engine's own expert kernels (`launch_experts`: gate/up then down, 4-bit
//! records of the released expert shape) are given table entries that point into a registered
//! read-only file mapping (as the pinned expert file is), so their weight loads cross the bus.
//! Timed by events on the compute stream, medians of 30 rounds, each round's records at fresh
//! offsets of a 768 MiB file (nothing served from the GPU's L2): ten experts in device memory
//! (a resident block); one and two over the bus; eight in device memory and two over the bus in
//! one launch (a block with two misses); and the copy engine's way for comparison (the two
//! records copied into device slots on the same stream, then their kernels). Before timing, the
//! outputs of a record read over the bus are checked equal to those of its copy in device memory.

use std::ffi::c_void;

use cherenkov_cuda::gpu::Gpu;
use cherenkov_cuda::weights::{ExpertIo, launch_experts};
use cherenkov_model::dtype::f32_to_bf16;
use cherenkov_model::quant::{Affine, QuantizedMatrix, quantize_matrix};
use cherenkov_model::store::{ExpertLayout, Precision, RecordMatrix, Span};
use cudarc::driver::result as cu;
use cudarc::driver::sys;

/// The released expert shape: intermediate width and hidden size.
const INTER: usize = 640;
const H: usize = 2560;
const FILE_BYTES: usize = 768 << 20;
const ROUNDS: usize = 30;

/// Standard-normal draws from a fixed seed (Box-Muller on a 64-bit LCG).
struct Normal(u64);

impl Normal {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn draw(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (self.uniform(), self.uniform());
                ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32 * std
            })
            .collect()
    }
}

/// One expert record of 4-bit rows in groups of 64 (gate, up, down with their scales and biases,
/// each piece 16-byte aligned) and its layout.
fn expert_record(rng: &mut Normal) -> (Vec<u8>, ExpertLayout) {
    let fmt = Affine::new(4, 64);
    let q = |rows: usize, cols: usize, rng: &mut Normal| {
        let bf: Vec<u16> = rng.draw(rows * cols, 0.05).iter().map(|&v| f32_to_bf16(v)).collect();
        quantize_matrix(&bf, rows, cols, fmt)
    };
    let (g, u, d) = (q(INTER, H, rng), q(INTER, H, rng), q(H, INTER, rng));
    let mut rec: Vec<u8> = Vec::new();
    let mut span = |bytes: Vec<u8>| {
        while !rec.len().is_multiple_of(16) {
            rec.push(0);
        }
        let s = Span { offset: rec.len() as u64, len: bytes.len() as u64 };
        rec.extend(bytes);
        s
    };
    let mut m = |q: &QuantizedMatrix, shape: [usize; 2]| RecordMatrix {
        shape,
        precision: Precision::Affine { bits: 4, group_size: 64 },
        data: span(q.words.iter().flat_map(|v| v.to_le_bytes()).collect()),
        scales: Some(span(q.scales.iter().flat_map(|v| v.to_le_bytes()).collect())),
        biases: Some(span(q.biases.iter().flat_map(|v| v.to_le_bytes()).collect())),
    };
    let layout = ExpertLayout {
        layer: "probe".into(),
        gate_proj: m(&g, [INTER, H]),
        up_proj: m(&u, [INTER, H]),
        down_proj: m(&d, [H, INTER]),
    };
    (rec, layout)
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn bus_expert_probe() {
    let gpu = Gpu::new().unwrap();
    let mut rng = Normal(7);
    let (rec, layout) = expert_record(&mut rng);
    let rb = rec.len().div_ceil(4096) * 4096;
    let in_file = FILE_BYTES / rb;
    // The file: the record again and again, one per `rb` bytes (its tail zero).
    let mut file = tempfile::tempfile().unwrap();
    let mut padded = rec.clone();
    padded.resize(rb, 0);
    for _ in 0..in_file {
        std::io::Write::write_all(&mut file, &padded).unwrap();
    }
    // SAFETY: a private temporary file nothing else writes; unregistered before the map drops.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    gpu.bind().unwrap();
    let flags = sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: the mapping lives until it is unregistered below.
    let reg = unsafe { sys::cuMemHostRegister_v2(map.as_ptr() as *mut c_void, map.len(), flags) };
    assert_eq!(reg, sys::CUresult::CUDA_SUCCESS, "registering the file mapping read-only and mapped");
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: the registered mapping's start.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut base, map.as_ptr() as *mut c_void, 0) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "the registered mapping's device address");

    let slots = gpu.alloc(10 * rb, "probe slots").unwrap();
    for i in 0..10 {
        gpu.htod(slots.at(i * rb), &padded).unwrap();
    }
    let x = rng.draw(H, 1.0);
    let dx = gpu.alloc(H * 4, "probe input").unwrap();
    gpu.htod(dx.ptr, &x).unwrap();
    let act = gpu.zeros(10 * INTER * 4, "probe act").unwrap();
    let out = gpu.zeros(10 * H * 4, "probe out").unwrap();
    let table = gpu.alloc(10 * 8, "probe table").unwrap();
    let io = ExpertIo::new(dx.ptr, act.ptr, out.ptr);
    let run = |entries: &[u64]| {
        launch_experts(&gpu, &layout, rb, table.ptr, 0, entries.len(), io, (INTER, H), &mut || Ok(())).unwrap();
    };
    let next = std::cell::Cell::new(0usize);
    let fresh = |n: usize| -> Vec<u64> {
        (0..n)
            .map(|_| {
                next.set((next.get() + 1) % in_file);
                base + (next.get() * rb) as u64
            })
            .collect()
    };
    let slot = |i: usize| slots.at(i * rb);

    // The same bytes read over the bus and from device memory give the same outputs.
    let mut entries = vec![slot(0)];
    entries.extend(fresh(1));
    gpu.htod(table.ptr, &entries).unwrap();
    run(&entries);
    gpu.sync().unwrap();
    let mut o = vec![0f32; 2 * H];
    gpu.dtoh(out.ptr, &mut o).unwrap();
    assert!(o[..H].iter().all(|v| v.is_finite()), "the probe's expert output is not finite");
    let scale = o[..H].iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let diff = o[..H].iter().zip(&o[H..]).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        diff <= 1e-5 * scale,
        "an expert read over the bus differs from its copy in device memory: {diff} of {scale}"
    );
    println!(
        "# bus expert probe on {}: 4-bit g64 records of {} bytes ({INTER}x{H} gate/up, {H}x{INTER} down), medians of {ROUNDS} rounds",
        gpu.info.name,
        rec.len()
    );
    println!(
        "# an expert read over the bus gives the output of its copy in device memory (max diff {diff:e} of {scale:e})"
    );
    println!("# each round is queued behind a stream wait on a host flag, so the GPU runs it back to back");

    // Each round: its table uploaded, then (queued behind a wait for the host's flag) a start
    // event, the copies `copies` names (file offsets into slots 8..), the experts, an end event.
    let flags = gpu.pinned(4096, "probe flag").unwrap();
    // SAFETY: mapped pinned memory of this context, zeroed before use.
    unsafe { flags.as_mut_slice::<u32>().iter_mut().for_each(|v| *v = 0) };
    let (start, end) = (gpu.event(true).unwrap(), gpu.event(true).unwrap());
    let round_id = std::cell::Cell::new(0u32);
    let time = |what: &str, bus_records: usize, plan: &dyn Fn() -> (Vec<u64>, Vec<u64>)| {
        let mut ms = Vec::new();
        for _ in 0..ROUNDS {
            let (entries, copies) = plan();
            gpu.sync().unwrap();
            gpu.htod(table.ptr, &entries).unwrap();
            round_id.set(round_id.get() + 1);
            // SAFETY: the flag word of the mapped buffer; a 32-bit wait for >= the round's id.
            unsafe { sys::cuStreamWaitValue32_v2(gpu.stream, flags.dev, round_id.get(), 0) }.result().unwrap();
            gpu.record(&start).unwrap();
            for (i, &src) in copies.iter().enumerate() {
                let at = (src - base) as usize;
                // SAFETY: the range lies in the registered mapping; the slot holds rb bytes.
                unsafe { cu::memcpy_htod_async(slot(8 + i), &map[at..at + rec.len()], gpu.stream) }.unwrap();
            }
            run(&entries);
            gpu.record(&end).unwrap();
            // SAFETY: the flag word; the device only reads it.
            unsafe { std::ptr::write_volatile(flags.host as *mut u32, round_id.get()) };
            gpu.sync().unwrap();
            ms.push(end.since(&start).unwrap());
        }
        let m = median(ms);
        let rate = if bus_records > 0 {
            format!("  {:5.1} GB/s over the bus", (bus_records * rec.len()) as f64 / (m as f64 * 1e-3) / 1e9)
        } else {
            String::new()
        };
        println!("{what:62} {:7.1} us{rate}", m * 1e3);
    };
    let resident = || (0..10).map(slot).collect::<Vec<u64>>();
    time("10 experts in device memory (a resident block)", 0, &|| (resident(), vec![]));
    time("2 experts in device memory", 0, &|| ((0..2).map(slot).collect(), vec![]));
    for n in [1usize, 2, 3] {
        time(&format!("{n} expert(s) read over the bus"), n, &|| (fresh(n), vec![]));
    }
    time("8 in device memory and 2 over the bus, one launch", 2, &|| {
        let mut e: Vec<u64> = (0..8).map(slot).collect();
        e.extend(fresh(2));
        (e, vec![])
    });
    time("2 copied by the copy engine (same stream), then their kernels", 2, &|| {
        ((8..10).map(slot).collect(), fresh(2))
    });
    time("2 copied, then 8 + 2 in one launch", 2, &|| (resident(), fresh(2)));

    gpu.sync().unwrap();
    // SAFETY: registered above; nothing reads it any more.
    unsafe { sys::cuMemHostUnregister(map.as_ptr() as *mut c_void) };
}
