//! Which launch shape makes the tiled matvec fastest for the decoder's large projections? A
//! measurement for the planner in weights.rs (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test matvec_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! Session 11 found, launching each kernel of a resident step twice in its graph, that the GDN input
//! projection costs about as much when its second launch finds the weights in L2 as the first does
//! from memory: bytes do not hold these kernels. This probe times the engine's own kernels
//! (`matvec_q4`, `matvec_many_48`, `expert_gate_up_q4` and `expert_down_q4`, launched with explicit
//! shapes) on the released shape's matrices, 4-bit with groups of 64, for many shapes: lanes per
//! tile and blocks. Each timing is a CUDA graph of 48 launches with programmatic dependent launch,
//! as resident steps replay, over copies of the weights that together pass four times the L2 (so
//! every launch reads memory), replayed 10 times after a warm-up. Next to them, a plain kernel that
//! only reads the same bytes (16-byte loads, 4 in flight per thread, a grid of 4 blocks per
//! multiprocessor) gives the ceiling for that size in the same graph. Run it again with
//! `CHERENKOV_KERNEL_DEFINES=MV_PROBE_NO_STAGE` or `MV_PROBE_NO_MATH` (linear.cu; wrong results) to
//! see what staging x and the dequantising arithmetic cost: session 11 found the arithmetic the
//! largest part. Results: `benchmark/results/matvec-probe-2026-11-30.txt`.

mod probe;

use std::ffi::{CString, c_void};

use cherenkov_cuda::gpu::{Arg, DevBuf, Gpu};
use cudarc::driver::result as cu;
use probe::{GS, LAUNCHES, Mat, REPLAYS, ROTATE_BYTES, time};

const SOURCE: &str = r#"
extern "C" __global__ void read_only(const uint4* __restrict__ p, long long n16, unsigned* out) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], e = p[i + 3 * stride];
        acc ^= a.x ^ a.w ^ b.y ^ b.z ^ c.x ^ c.w ^ e.y ^ e.z;
    }
    for (; i < n16; i += stride) {
        uint4 a = p[i];
        acc ^= a.x ^ a.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"#;

/// linear.cu's `MV_TILED`.
const MV_TILED: i32 = 0x10000;

fn ptx(arch: &'static str) -> String {
    let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).unwrap_or_else(|e| panic!("{e:?}")).to_src()
}

/// The probe's own kernel compiles (so the measurement does not fail on the GPU machine for a typo).
#[test]
fn matvec_probe_kernel_compiles() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    assert!(ptx("sm_90").contains(".entry read_only("));
}

/// Shared memory of the tiled kernels for `cols` inputs at 4 bits (weights.rs's `tiled_shmem`).
fn shmem(cols: usize) -> u32 {
    (cols * 4 + cols / 32 * 4) as u32
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn matvec_probe() {
    let gpu = Gpu::new().unwrap();
    let (maj, min) = gpu.info.compute_capability;
    let arch = cherenkov_cuda::compile::arch_name(maj, min).unwrap();
    let cptx = CString::new(ptx(arch)).unwrap();
    gpu.bind().unwrap();
    // SAFETY: a NUL-terminated PTX image holding `read_only`.
    let read_only = unsafe {
        let m = cu::module::load_data(cptx.as_ptr() as *const c_void).unwrap();
        cu::module::get_function(m, CString::new("read_only").unwrap()).unwrap()
    };
    let sms = 132usize;
    let x = gpu.zeros(16384 * 4, "probe x").unwrap();
    let xv: Vec<f32> = (0..16384).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    gpu.htod(x.ptr, &xv).unwrap();
    let y = gpu.zeros(4 * 16384 * 4, "probe y").unwrap();
    let out = gpu.zeros(256, "probe out").unwrap();
    println!(
        "# matvec probe on {}: us per launch, graphs of {LAUNCHES} launches with PDL, {REPLAYS} replays",
        gpu.info.name
    );

    // The ceiling: the same bytes read by a plain kernel.
    let ceiling = |m: &Mat| {
        time(&gpu, |i| {
            let (w, _, _) = m.copy(i);
            let args = [Arg::Ptr(w), Arg::U64((m.rows * m.cols / 32) as u64), Arg::Ptr(out.ptr)];
            // SAFETY: read_only(const uint4*, long long, unsigned*) over the copy's words.
            unsafe { gpu.launch_function(read_only, "read_only", ((sms * 4) as u32, 1, 1), 256, 0, &args, true) }
                .unwrap();
        })
    };
    let report = |what: &str, bytes: usize, us: f64| {
        println!("{what:<60} {us:8.2} us  {:7.0} GB/s", bytes as f64 / (us * 1e-6) / 1e9);
    };

    // One matrix through matvec_q4 (the GDN and attention out_proj: 2560 x 6144; the shared
    // expert's down projection: 2560 x 640). The out_proj with 1280 rows more is what the idea of
    // computing the next read's down projection by linearity in its launch would read (the next
    // read's four streams' 320 rows times W_o, precomputed at 4 bits: notes-cuda.md, "Session
    // 65"); with 2560 more, the bytes of those rows at 8 bits.
    for (name, rows, cols) in [
        ("out_proj 2560x6144", 2560usize, 6144usize),
        ("out_proj and the next read's rows at 4 bits 3840x6144", 3840, 6144),
        ("out_proj and the next read's rows' bytes at 8 bits 5120x6144", 5120, 6144),
        ("shared down 2560x640", 2560, 640),
    ] {
        let m = Mat::new(&gpu, rows, cols);
        println!("\n## {name}: {} copies of {:.2} MB", m.copies.len(), m.bytes() as f64 / 1e6);
        report("read only (the ceiling)", m.bytes(), ceiling(&m));
        let (tiles, chunks) = (rows / 4, cols / 32);
        for lanes in [8usize, 16, 32, 64, 128, 256] {
            if lanes > chunks.next_power_of_two() {
                continue;
            }
            let per_block = 256 / lanes;
            let needed = tiles.div_ceil(per_block);
            let mut shapes = vec![needed, needed.min(396), needed.min(264), needed.min(132)];
            shapes.dedup();
            for blocks in shapes {
                let us = time(&gpu, |i| probe::engine_q4(&gpu, 1, &m, i, x.ptr, y.ptr, lanes, blocks, 256));
                let steps = chunks.div_ceil(lanes);
                let passes = needed.div_ceil(blocks);
                report(
                    &format!("lanes {lanes:3}, {blocks:3} blocks ({passes} pass(es) of {steps} steps)"),
                    m.bytes(),
                    us,
                );
            }
        }
    }

    // The GDN input projection: qkv (10240 rows), z (6144), b and a (48 each) of 2560 inputs in
    // one matvec_many_48 launch; (lanes, blocks) per part.
    let parts = [10240usize, 6144, 48, 48].map(|r| Mat::new(&gpu, r, 2560));
    let total: usize = parts.iter().map(Mat::bytes).sum();
    println!("\n## GDN in_proj (qkv, z, b, a) x 2560: {:.2} MB", total as f64 / 1e6);
    let all = time(&gpu, |i| {
        for m in &parts {
            let (w, _, _) = m.copy(i);
            let args = [Arg::Ptr(w), Arg::U64((m.rows * m.cols / 32) as u64), Arg::Ptr(out.ptr)];
            // SAFETY: as above.
            unsafe { gpu.launch_function(read_only, "read_only", ((sms * 4) as u32, 1, 1), 256, 0, &args, true) }
                .unwrap();
        }
    });
    report("read only, one launch per part (the ceiling)", total, all);
    let plans: [(&str, [(usize, usize); 2]); 11] = [
        ("each part alone (today)", [(32, 320), (64, 384)]),
        ("joint shares (the default since session 11)", [(16, 160), (16, 96)]),
        ("8 lanes, one pass", [(8, 80), (8, 48)]),
        ("8 lanes, 2 blocks per SM", [(8, 160), (8, 96)]),
        ("16 lanes, 2 passes", [(16, 80), (16, 48)]),
        ("32 lanes, one wave", [(32, 244), (32, 148)]),
        ("64 lanes", [(64, 640), (64, 384)]),
        ("32 lanes qkv, 16 lanes z", [(32, 320), (16, 96)]),
        ("16 lanes qkv, 32 lanes z", [(16, 160), (32, 192)]),
        ("16 lanes qkv, 64 lanes z", [(16, 160), (64, 384)]),
        ("32 lanes, 2 passes", [(32, 160), (32, 96)]),
    ];
    for (what, p) in plans {
        let grid_x = p[0].1.max(p[1].1).max(6);
        let us = time(&gpu, |i| {
            let mut args = vec![
                Arg::Ptr(x.ptr),
                Arg::Ptr(0),
                Arg::F32(0.0),
                Arg::I32(0),
                Arg::I32(2560),
                Arg::Ptr(gpu.split_scratch_ptr()),
            ];
            for (k, m) in parts.iter().enumerate() {
                let (lanes, nb) = if k < 2 { p[k] } else { (64, 3) };
                let (w, s, b) = m.copy(i);
                args.extend([
                    Arg::Ptr(w),
                    Arg::Ptr(s),
                    Arg::Ptr(b),
                    Arg::Ptr(y.ptr + (k * 16384 * 4) as u64),
                    Arg::I32(m.rows as i32),
                    Arg::I32(lanes as i32),
                    Arg::I32(nb as i32),
                    Arg::I32(1),
                    Arg::I32(4),
                    Arg::I32(GS as i32),
                ]);
            }
            args.extend(no_extras());
            gpu.launch("matvec_many_48", (grid_x as u32, 4, 1), 256, shmem(2560), &args).unwrap();
        });
        report(&format!("{what}: qkv {:?}, z {:?}", p[0], p[1]), total, us);
    }

    // out_proj with its columns split (matvec_many_48, one part of k slices, each block staging its
    // slice of x; the last block adds the slices' partial sums).
    let m = Mat::new(&gpu, 2560, 6144);
    println!("\n## out_proj 2560x6144 split into column slices (matvec_many_48, one part)");
    for k in [2usize, 4] {
        let chunks = 192 / k;
        for lanes in [16usize, 32, 64, 128] {
            if lanes > chunks.next_power_of_two() {
                continue;
            }
            let needed = 640usize.div_ceil(256 / lanes);
            let mut shapes = vec![needed, needed.min(396 / k), needed.min(264 / k)];
            shapes.dedup();
            for nb in shapes {
                let us = time(&gpu, |i| {
                    let (w, s, b) = m.copy(i);
                    let mut args = vec![
                        Arg::Ptr(x.ptr),
                        Arg::Ptr(0),
                        Arg::F32(0.0),
                        Arg::I32(0),
                        Arg::I32(6144),
                        Arg::Ptr(gpu.split_scratch_ptr()),
                    ];
                    args.extend([
                        Arg::Ptr(w),
                        Arg::Ptr(s),
                        Arg::Ptr(b),
                        Arg::Ptr(y.ptr),
                        Arg::I32(2560),
                        Arg::I32(lanes as i32),
                        Arg::I32(nb as i32),
                        Arg::I32(k as i32),
                        Arg::I32(4),
                        Arg::I32(GS as i32),
                    ]);
                    for _ in 1..4 {
                        args.extend([
                            Arg::Ptr(0),
                            Arg::Ptr(0),
                            Arg::Ptr(0),
                            Arg::Ptr(0),
                            Arg::I32(0),
                            Arg::I32(1),
                            Arg::I32(0),
                            Arg::I32(1),
                            Arg::I32(4),
                            Arg::I32(GS as i32),
                        ]);
                    }
                    args.extend(no_extras());
                    gpu.launch("matvec_many_48", ((nb * k) as u32, 1, 1), 256, shmem(6144 / k), &args).unwrap();
                });
                let steps = chunks.div_ceil(lanes);
                report(&format!("{k} slices, lanes {lanes:3}, {nb:3} blocks per slice ({steps} steps)"), m.bytes(), us);
            }
        }
    }

    // Ten experts of the released shape (gate and up 640 x 2560, down 2560 x 640), records laid out
    // as the store's (words, scales, biases of gate, up, down), through expert_gate_up_q4 and
    // expert_down_q4 with an address table of ten entries per launch.
    let (inter, h) = (640usize, 2560usize);
    let mat_bytes = |rows: usize, cols: usize| (rows * cols / 2, rows * cols / GS * 2);
    let (gw, gsb) = mat_bytes(inter, h);
    let (dw, dsb) = mat_bytes(h, inter);
    // Offsets in a record: gate (w, s, b), up (w, s, b), down (w, s, b).
    let offs = [0, gw, gw + gsb, gw + 2 * gsb, 2 * gw + 2 * gsb, 2 * gw + 3 * gsb, 2 * gw + 4 * gsb];
    let offs = [offs[0], offs[1], offs[2], offs[3], offs[4], offs[5], offs[6], offs[6] + dw, offs[6] + dw + dsb];
    let record = (offs[8] + dsb).div_ceil(256) * 256;
    let sets = ROTATE_BYTES.div_ceil(10 * record).max(2);
    let pool = gpu.alloc(sets * 10 * record, "probe expert records").unwrap();
    {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut bytes = vec![0u8; record];
        for r in 0..sets * 10 {
            for (i, v) in bytes.iter_mut().enumerate() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *v = seed as u8;
                // Scales and biases: bf16 of about 1e-2 and -1e-1.
                let in_sb = [(offs[1], offs[3]), (offs[4], offs[6]), (offs[7], offs[8] + dsb)]
                    .iter()
                    .any(|&(a, b)| i >= a && i < b);
                if in_sb && i % 2 == 1 {
                    *v = if seed & 1 == 0 { 0x3c } else { 0xbd };
                }
            }
            gpu.htod(pool.ptr + (r * record) as u64, &bytes).unwrap();
        }
    }
    let tables: Vec<DevBuf> = (0..sets)
        .map(|s| {
            let t: Vec<u64> = (0..10).map(|e| pool.ptr + ((s * 10 + e) * record) as u64).collect();
            let buf = gpu.alloc(80, "probe table").unwrap();
            gpu.htod(buf.ptr, &t).unwrap();
            buf
        })
        .collect();
    let act = gpu.zeros(10 * inter * 4, "probe act").unwrap();
    let eout = gpu.zeros(10 * h * 4, "probe expert out").unwrap();
    let gu_bytes = 10 * 2 * (gw + 2 * gsb);
    let d_bytes = 10 * (dw + 2 * dsb);
    println!(
        "\n## ten experts: gate/up {:.2} MB, down {:.2} MB; {sets} sets of records",
        gu_bytes as f64 / 1e6,
        d_bytes as f64 / 1e6
    );
    let ceil_gu = time(&gpu, |i| {
        let base = pool.ptr + ((i % sets) * 10 * record) as u64;
        let args = [Arg::Ptr(base), Arg::U64((10 * record / 16) as u64 * 2 / 3), Arg::Ptr(out.ptr)];
        // SAFETY: as above (two thirds of the set's bytes: about its gate and up projections).
        unsafe { gpu.launch_function(read_only, "read_only", ((sms * 4) as u32, 1, 1), 256, 0, &args, true) }.unwrap();
    });
    report("read only, two thirds of ten records (the gate/up ceiling)", gu_bytes, ceil_gu);
    for lanes in [16usize, 32, 64] {
        let needed = 320usize.div_ceil(256 / lanes);
        let mut shapes = vec![needed, needed.min(40), needed.min(39), needed.min(26), needed.min(13)];
        shapes.dedup();
        for nb in shapes {
            let us = time(&gpu, |i| {
                let args = gate_up_args(tables[i % sets].ptr, x.ptr, act.ptr, (inter, h), lanes, &offs[..6]);
                gpu.launch("expert_gate_up_q4", (nb as u32, 10, 1), 256, shmem(h), &args).unwrap();
            });
            let steps = 80usize.div_ceil(lanes);
            report(&format!("gate/up lanes {lanes:3}, {nb:3} blocks x 10 ({steps} steps)"), gu_bytes, us);
        }
    }
    for lanes in [8usize, 16, 32] {
        let needed = 640usize.div_ceil(256 / lanes);
        let mut shapes = vec![needed, needed.min(40), needed.min(39), needed.min(26)];
        shapes.dedup();
        for nb in shapes {
            let us = time(&gpu, |i| {
                let args = down_args(tables[i % sets].ptr, act.ptr, eout.ptr, (inter, h), lanes, &offs[6..]);
                gpu.launch("expert_down_q4", (nb as u32, 10, 1), 256, shmem(inter), &args).unwrap();
            });
            let steps = 20usize.div_ceil(lanes);
            report(&format!("down lanes {lanes:3}, {nb:3} blocks x 10 ({steps} steps)"), d_bytes, us);
        }
    }
}

/// What both expert kernels take first: the records' table, its first entry, the input and output,
/// the dims, the group size, the tiled core's lanes, and the matrices' offsets in a record.
fn expert_args(table: u64, input: u64, output: u64, dims: (usize, usize), lanes: usize, offs: &[usize]) -> Vec<Arg> {
    let mut v = vec![
        Arg::Ptr(table),
        Arg::I32(0),
        Arg::Ptr(input),
        Arg::Ptr(output),
        Arg::I32(dims.0 as i32),
        Arg::I32(dims.1 as i32),
        Arg::I32(GS as i32),
        Arg::I32(MV_TILED | lanes as i32),
    ];
    v.extend(offs.iter().map(|&o| Arg::U64(o as u64)));
    v
}

/// `expert_gate_up_q4`'s arguments (weights.rs's `launch_experts`) for ten records whose
/// addresses are in `table`, of `dims` (intermediate, hidden) and gate/up at `offs` (words, scales,
/// biases of each) in a record: tiled with `lanes`, no stamps, no shared expert riding along, no
/// flag to wait for.
fn gate_up_args(table: u64, x: u64, act: u64, dims: (usize, usize), lanes: usize, offs: &[usize]) -> Vec<Arg> {
    let mut v = expert_args(table, x, act, dims, lanes, offs);
    // stamp, the shared expert's gate and up (words, scales, biases), its group size and outputs,
    // and the flag.
    v.extend([Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0)]);
    v.extend([Arg::I32(1), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0)]);
    v
}

/// `expert_down_q4`'s arguments, as [`gate_up_args`]'s, for the down projection at `offs`.
fn down_args(table: u64, act: u64, out: u64, dims: (usize, usize), lanes: usize, offs: &[usize]) -> Vec<Arg> {
    let mut v = expert_args(table, act, out, dims, lanes, offs);
    // The shared expert's down (words, scales, biases), its group size, gate, up and output, and
    // the flag.
    v.extend([Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::I32(1), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0)]);
    v
}

/// The parameters of every kernel definition named `name` in the engine's CUDA source, counted
/// from their signatures' commas (a name with the macros' `##B` is only ever defined). A list that
/// is one macro (`EXPERT_GATE_UP_ARGS`) counts that macro's parameters.
fn kernel_params(name: &str) -> Vec<usize> {
    let src = cherenkov_cuda::compile::source();
    let count = |list: &str| list.matches(',').count() + 1;
    src.match_indices(&format!("{name}("))
        .map(|(i, m)| {
            let rest = &src[i + m.len()..];
            let list = rest[..rest.find(')').expect("a closed parameter list")].trim();
            if !list.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return count(list);
            }
            let (at, _) = src.match_indices(&format!("#define {list}")).next().expect("the parameter list's macro");
            // The macro's body: its lines up to the first that does not end in a backslash.
            let body = src[at..].split_inclusive('\n').take_while(|l| l.trim_end().ends_with('\\')).collect::<String>();
            let last = src[at + body.len()..].lines().next().unwrap_or("");
            count(&(body + last)[format!("#define {list}").len()..])
        })
        .collect()
}

/// The probe's launches of the engine's expert kernels pass as many arguments as the kernels take
/// (a launch with fewer fails on the GPU machine with an invalid argument, as session 44's probe
/// did after the kernels grew).
#[test]
fn expert_launch_arguments_match_the_kernels() {
    let offs = [0; 9];
    for (name, n) in [
        ("expert_gate_up_q##B", gate_up_args(0, 0, 0, (640, 2560), 16, &offs[..6]).len()),
        ("expert_down_q##B", down_args(0, 0, 0, (640, 2560), 16, &offs[6..]).len()),
    ] {
        let found = kernel_params(name);
        assert!(!found.is_empty(), "{name} not found in the engine's source");
        assert!(found.iter().all(|&p| p == n), "{name} takes {found:?} parameters, the probe passes {n}");
    }
}

/// `matvec_many_48`'s arguments after its parts: no folded norm, no folded conv, no deferred parts,
/// no weights ahead.
fn no_extras() -> [Arg; 8] {
    [Arg::I32(0), Arg::F32(0.0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::I32(0), Arg::I32(0), Arg::I32(0)]
}
