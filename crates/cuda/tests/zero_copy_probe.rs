//! Can the GPU's own loads read a missing expert from pinned host memory faster than the copy
//! engine copies it? A measurement for the streamed MoE block (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test zero_copy_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! A streamed block copies each miss (a 2.64 MiB record) from the registered expert file into a
//! device slot, then runs the read experts' kernels on the slot. Session 7 measured those copies
//! at 44-49 GB/s, about 13 us per copy beyond the link's 55 GB/s. Here the same bytes are read
//! three ways, each from a registered read-only file mapping (as the pinned expert file is) and
//! timed by events on the GPU: by the copy engine, one copy per record (also: each record in two
//! parts, as the engine copies a miss's gate/up and down projections; all records in one
//! `cuMemcpyBatchAsync`; the records on two streams at once); by a kernel whose blocks
//! load the records over the bus (zero-copy), for several grid sizes; and by the same kernel also
//! writing what it read into a device buffer (a slot filled on the way). The records of each round
//! lie at fresh offsets of a 512 MiB file, so nothing is served from the GPU's L2.

use std::ffi::{CString, c_void};

use cherenkov_cuda::gpu::{Arg, Gpu};
use cudarc::driver::result as cu;
use cudarc::driver::sys;

const SOURCE: &str = r#"
extern "C" __global__ void zc_read(unsigned long long s0, unsigned long long s1, unsigned long long s2,
                                   unsigned long long s3, long long n16, uint4* dst, unsigned* out) {
    unsigned long long base = blockIdx.y == 0 ? s0 : blockIdx.y == 1 ? s1 : blockIdx.y == 2 ? s2 : s3;
    const uint4* src = (const uint4*)base;
    uint4* d = dst ? dst + (long long)blockIdx.y * n16 : 0;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], e = src[i + 3 * stride];
        acc ^= a.x ^ a.w ^ b.y ^ b.z ^ c.x ^ c.w ^ e.y ^ e.z;
        if (d) { d[i] = a; d[i + stride] = b; d[i + 2 * stride] = c; d[i + 3 * stride] = e; }
    }
    for (; i < n16; i += stride) {
        uint4 a = src[i];
        acc ^= a.x ^ a.w;
        if (d) d[i] = a;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"#;

/// Bytes of one expert record of the released shape.
const RECORD: usize = 2_768_896;
/// The registered file: records of each round are taken at fresh offsets of it.
const FILE_BYTES: usize = 512 << 20;

fn ptx(arch: &'static str) -> String {
    let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).unwrap_or_else(|e| panic!("{e:?}")).to_src()
}

/// The probe's kernel compiles (so the measurement does not fail on the GPU machine for a typo).
#[test]
fn zero_copy_probe_kernel_compiles() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    assert!(ptx("sm_90").contains(".entry zc_read("));
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn zero_copy_probe() {
    let gpu = Gpu::new().unwrap();
    let (maj, min) = gpu.info.compute_capability;
    let arch = cherenkov_cuda::compile::arch_name(maj, min).unwrap();
    let cptx = CString::new(ptx(arch)).unwrap();
    gpu.bind().unwrap();
    // SAFETY: a NUL-terminated PTX image holding `zc_read`.
    let kernel = unsafe {
        let m = cu::module::load_data(cptx.as_ptr() as *const c_void).unwrap();
        cu::module::get_function(m, CString::new("zc_read").unwrap()).unwrap()
    };
    let s = gpu.stream;
    let mut file = tempfile::tempfile().unwrap();
    let fill: Vec<u8> = (0..FILE_BYTES).map(|i| (i * 7 + (i >> 12)) as u8).collect();
    std::io::Write::write_all(&mut file, &fill).unwrap();
    drop(fill);
    // SAFETY: a private temporary file nothing else writes; unregistered before the map drops.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let flags = sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    let reg = unsafe { sys::cuMemHostRegister_v2(map.as_ptr() as *mut c_void, map.len(), flags) };
    assert_eq!(reg, sys::CUresult::CUDA_SUCCESS, "registering the file mapping read-only and mapped");
    let mut base: sys::CUdeviceptr = 0;
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut base, map.as_ptr() as *mut c_void, 0) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "the registered mapping's device address");
    let same = gpu
        .ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)
        .unwrap();
    println!(
        "# zero-copy probe on {}: registered file mapping, device address {} the host's",
        gpu.info.name,
        if base == map.as_ptr() as u64 { "=" } else { "!=" }
    );
    println!("# CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = {same}; record {RECORD} bytes; medians of 40 rounds");
    let dev = gpu.zeros(4 * RECORD, "probe slots").unwrap();
    let out = gpu.zeros(256, "probe out").unwrap();
    let (start, end) = (gpu.event(true).unwrap(), gpu.event(true).unwrap());
    let mut round = 0usize;
    let mut offsets = |n: usize| -> Vec<usize> {
        (0..n)
            .map(|_| {
                round += 1;
                (round * RECORD * 5) % (FILE_BYTES - RECORD) / 4096 * 4096
            })
            .collect()
    };
    let rounds = 40;
    let gbps = |records: usize, ms: f32| (records * RECORD) as f64 / (ms as f64 * 1e-3) / 1e9;
    // Check the kernel's copy once: the bytes in the device buffer are the file's.
    {
        let offs = offsets(2);
        let args = [
            Arg::U64(base + offs[0] as u64),
            Arg::U64(base + offs[1] as u64),
            Arg::U64(0),
            Arg::U64(0),
            Arg::U64((RECORD / 16) as u64),
            Arg::Ptr(dev.ptr),
            Arg::Ptr(out.ptr),
        ];
        unsafe { gpu.launch_function(kernel, "zc_read", (66, 2, 1), 256, 0, &args, false).unwrap() };
        gpu.sync().unwrap();
        let mut back = vec![0u8; 2 * RECORD];
        gpu.dtoh(dev.ptr, &mut back).unwrap();
        assert!(back[..RECORD] == map[offs[0]..offs[0] + RECORD], "record 0 read through the bus differs");
        assert!(back[RECORD..] == map[offs[1]..offs[1] + RECORD], "record 1 read through the bus differs");
        println!("# the kernel's copies of two records match the file");
    }
    for records in [1usize, 2, 4] {
        let mut copy = Vec::new();
        for _ in 0..rounds {
            let offs = offsets(records);
            gpu.record(&start).unwrap();
            for (k, &o) in offs.iter().enumerate() {
                // SAFETY: inside the registered map; the device buffer holds 4 records.
                unsafe { cu::memcpy_htod_async(dev.at(k * RECORD), &map[o..o + RECORD], s).unwrap() };
            }
            gpu.record(&end).unwrap();
            end.wait().unwrap();
            copy.push(end.since(&start).unwrap());
        }
        let ms = median(copy);
        println!(
            "{records} record(s), copy engine (one copy each)      {:8.1} us  {:6.1} GB/s",
            ms * 1e3,
            gbps(records, ms)
        );
        let report = |what: &str, t: Vec<f32>| {
            let ms = median(t);
            println!("{records} record(s), copy engine, {what:18} {:8.1} us  {:6.1} GB/s", ms * 1e3, gbps(records, ms));
        };
        // Each record in two parts: the first 2/3 (gate and up), then the rest (down).
        let front = (RECORD * 2 / 3) & !4095;
        let mut t = Vec::new();
        for _ in 0..rounds {
            let offs = offsets(records);
            gpu.record(&start).unwrap();
            for (k, &o) in offs.iter().enumerate() {
                for (a, b) in [(0, front), (front, RECORD)] {
                    // SAFETY: inside the registered map; the device buffer holds 4 records.
                    unsafe { cu::memcpy_htod_async(dev.at(k * RECORD + a), &map[o + a..o + b], s).unwrap() };
                }
            }
            gpu.record(&end).unwrap();
            end.wait().unwrap();
            t.push(end.since(&start).unwrap());
        }
        report("two parts each", t);
        // All records in one batch call.
        let mut t = Vec::new();
        for _ in 0..rounds {
            let offs = offsets(records);
            let mut dsts: Vec<sys::CUdeviceptr> = (0..records).map(|k| dev.at(k * RECORD)).collect();
            let mut srcs: Vec<sys::CUdeviceptr> = offs.iter().map(|&o| map.as_ptr() as u64 + o as u64).collect();
            let mut sizes = vec![RECORD; records];
            // SAFETY: a zeroed attribute is a valid value of this plain C struct.
            let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            attr.srcLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
            attr.dstLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            let mut idx = 0usize;
            gpu.record(&start).unwrap();
            // SAFETY: every range lies in the registered map or the device buffer; one attribute
            // for all copies (from index 0).
            let r = unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    records,
                    &mut attr,
                    &mut idx,
                    1,
                    s,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                println!("{records} record(s), cuMemcpyBatchAsync failed: {r:?}");
                break;
            }
            gpu.record(&end).unwrap();
            end.wait().unwrap();
            t.push(end.since(&start).unwrap());
        }
        if !t.is_empty() {
            report("one batch call", t);
        }
        // The records on two streams at once (the second starts with the first).
        if records > 1 {
            let s2 = cu::stream::create(cu::stream::StreamKind::NonBlocking).unwrap();
            let go = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
            let done2 = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
            let mut t = Vec::new();
            for _ in 0..rounds {
                let offs = offsets(records);
                gpu.record(&start).unwrap();
                // SAFETY (this block): events and streams of this context; ranges as above.
                unsafe {
                    cu::event::record(go, s).unwrap();
                    cu::stream::wait_event(s2, go, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap();
                    for (k, &o) in offs.iter().enumerate() {
                        let st = if k % 2 == 0 { s } else { s2 };
                        cu::memcpy_htod_async(dev.at(k * RECORD), &map[o..o + RECORD], st).unwrap();
                    }
                    cu::event::record(done2, s2).unwrap();
                    cu::stream::wait_event(s, done2, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap();
                }
                gpu.record(&end).unwrap();
                end.wait().unwrap();
                t.push(end.since(&start).unwrap());
            }
            report("two streams", t);
        }
        for write in [false, true] {
            for blocks in [8u32, 16, 33, 66, 132] {
                let mut t = Vec::new();
                for _ in 0..rounds {
                    let offs = offsets(records);
                    let p = |k: usize| Arg::U64(offs.get(k).map_or(0, |&o| base + o as u64));
                    let args = [
                        p(0),
                        p(1),
                        p(2),
                        p(3),
                        Arg::U64((RECORD / 16) as u64),
                        Arg::Ptr(if write { dev.ptr } else { 0 }),
                        Arg::Ptr(out.ptr),
                    ];
                    gpu.record(&start).unwrap();
                    // SAFETY: zc_read's parameters in order; every address lies in the registered map.
                    unsafe {
                        gpu.launch_function(kernel, "zc_read", (blocks, records as u32, 1), 256, 0, &args, false)
                            .unwrap()
                    };
                    gpu.record(&end).unwrap();
                    end.wait().unwrap();
                    t.push(end.since(&start).unwrap());
                }
                let ms = median(t);
                println!(
                    "{records} record(s), kernel {} {blocks:3} blocks per record {:8.1} us  {:6.1} GB/s",
                    if write { "read+write," } else { "read only, " },
                    ms * 1e3,
                    gbps(records, ms)
                );
            }
        }
    }
    unsafe { sys::cuMemHostUnregister(map.as_ptr() as *mut c_void) };
}
