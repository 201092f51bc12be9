//! The timeline analysis scripts (`tools/gpu/timeline_tails.py`, `timeline_sms.py`,
//! `timeline_marks.py`, `timeline_phases.py`, `timeline_blocks.py`; `timeline_kernels.py` and
//! `timeline_heads_tails.py` on launch tables; `timeline.sh`, which runs the bench for them, with a
//! stand-in binary) on records made up here, so that a change to the record format or the grouping
//! shows before a device call does. Needs `python3` and `bash` (CI has them).

use std::path::{Path, PathBuf};
use std::process::Command;

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/gpu").join(name)
}

/// The columns of `name`'s row for kernel `k`, run on [`records`].
fn row_of(name: &str) -> Vec<String> {
    row_in(name, &records())
}

/// What script `name` prints, run on a file `file` holding `text`.
fn output_of(name: &str, file: &str, text: &str) -> String {
    output_with(name, &[], file, text)
}

/// [`output_of`] with `args` before the file.
fn output_with(name: &str, args: &[&str], file: &str, text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file);
    std::fs::write(&path, text).unwrap();
    let out = Command::new("python3").arg(script(name)).args(args).arg(&path).output().expect("python3 runs");
    assert!(out.status.success(), "{name} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// The columns of `name`'s row for kernel `k`, run on `records`.
fn row_in(name: &str, records: &str) -> Vec<String> {
    let out = output_of(name, "tl-step1.blocks.tsv", records);
    let row = out.lines().find(|l| l.starts_with("k ")).unwrap_or_else(|| panic!("no row for k in:\n{out}"));
    row.split_whitespace().map(str::to_string).collect()
}

/// One launch of `k` with a grid of 8 blocks: 6 working blocks (3 on multiprocessor 0, one each on
/// 1, 2 and 3) and 2 that return at once; times in ns, the wait passed at 1000.
fn records() -> String {
    let mut s = String::from("kernel\tblock\tblocks\tsm\tstart_ns\twaited_ns\tend_ns\n");
    let working = [(0, 0, 9000), (1, 0, 9000), (2, 0, 13000), (3, 1, 7000), (4, 2, 7000), (5, 3, 7000)];
    for (block, sm, end) in working {
        s += &format!("k\t{block}\t8\t{sm}\t500\t1000\t{end}\n");
    }
    for block in [6, 7] {
        s += &format!("k\t{block}\t8\t4\t900\t1000\t1200\n");
    }
    s
}

#[test]
fn the_sms_script_counts_working_blocks_per_multiprocessor() {
    let cols = row_of("timeline_sms.py");
    // kernel, grid, launches, working blocks, multiprocessors, held 1/2/3/4+, mean end, last end.
    assert_eq!(cols[1..6], ["8", "1", "6", "4", "3/0/1/0"], "{cols:?}");
    // Ends after the wait: 8, 8, 12, 6, 6, 6 us.
    assert_eq!(cols[6..8], ["7.67", "12.00"], "{cols:?}");
}

/// `timeline_blocks.py` on one launch: blocks 0-5 pass their waits at 1.0 + 0.1 b us and end at
/// 9 - 0.5 b us; block 6 returned before its wait (-1) and block 7 passed its wait at 5 us, outside
/// the window asked for.
#[test]
fn the_blocks_script_names_the_last_blocks_past_the_wait_and_to_end() {
    let mut records = String::from("kernel\tblock\tblocks\tsm\tstart_ns\twaited_ns\tend_ns\n");
    for b in 0..6 {
        records += &format!("k\t{b}\t8\t{b}\t500\t{}\t{}\n", 1000 + 100 * b, 9000 - 500 * b);
    }
    records += "k\t6\t8\t1\t900\t-1\t950\nk\t7\t8\t2\t4000\t5000\t6000\n";
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tl-step1.blocks.tsv");
    std::fs::write(&path, records).unwrap();
    let out = Command::new("python3")
        .arg(script("timeline_blocks.py"))
        .arg(&path)
        .args(["k", "0.9", "2"])
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "timeline_blocks.py failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("UTF-8 output");
    assert!(text.starts_with("k: 6 blocks, the first past its wait at 1.00 us\n"), "{text}");
    let line = |start: &str| {
        text.lines().find(|l| l.starts_with(start)).unwrap_or_else(|| panic!("no line {start:?} in:\n{text}"))
    };
    assert_eq!(
        line("last past the wait:"),
        "last past the wait: block 5 sm 5 waited 0.50 end 5.50  block 4 sm 4 waited 0.40 end 6.00  \
         block 3 sm 3 waited 0.30 end 6.50  block 2 sm 2 waited 0.20 end 7.00"
    );
    assert_eq!(
        line("last to end:"),
        "last to end: block 0 sm 0 waited 0.00 end 8.00  block 1 sm 1 waited 0.10 end 7.50  \
         block 2 sm 2 waited 0.20 end 7.00  block 3 sm 3 waited 0.30 end 6.50"
    );
}

#[test]
fn the_tails_script_reads_the_same_records() {
    let cols = row_of("timeline_tails.py");
    // Ends of all 8 blocks: 0.2, 0.2, 6, 6, 6, 8, 8, 12 us; the median's index rounds 3.5 to 4.
    assert_eq!(cols[1..], ["1", "6.00", "8.00", "12.00", "6.00"], "{cols:?}");
}

/// [`records`] as written since session 22, with the marks: the working blocks 0-4 passed theirs
/// at 2, 2, 4, 3 and 3 us, block 5 and the blocks that return at once never did (-1).
fn records_marked() -> String {
    let marks = ["2000", "2000", "4000", "3000", "3000", "-1", "-1", "-1"];
    let mut lines = records().lines().map(str::to_string).collect::<Vec<_>>();
    lines[0] += "\tmarked_ns";
    for (line, mark) in lines[1..].iter_mut().zip(marks) {
        *line += &format!("\t{mark}");
    }
    lines.join("\n") + "\n"
}

#[test]
fn the_marks_script_splits_the_marked_blocks_at_their_mark() {
    let cols = row_in("timeline_marks.py", &records_marked());
    // kernel, grid, launches, marked working blocks, wait spread, wait-mark, mark-end, last mark-end.
    assert_eq!(cols[1..4], ["8", "1", "5"], "{cols:?}");
    // Waits all at 1 us; marks 1, 1, 3, 2, 2 us after them; ends 7, 7, 9, 4, 4 us after the marks.
    assert_eq!(cols[4..], ["0.00", "1.80", "6.20", "9.00"], "{cols:?}");
}

#[test]
fn the_other_scripts_read_records_with_marks() {
    assert_eq!(row_in("timeline_sms.py", &records_marked()), row_of("timeline_sms.py"));
    assert_eq!(row_in("timeline_tails.py", &records_marked()), row_of("timeline_tails.py"));
}

/// [`records_marked`] with the working blocks 0-4 marked at 5 us instead (a second timeline, at
/// another mark).
fn records_marked_later() -> String {
    records_marked().replace("\t2000\n", "\t5000\n").replace("\t3000\n", "\t5000\n").replace("\t4000\n", "\t5000\n")
}

#[test]
fn the_phases_script_puts_each_files_mark_beside_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("m0.blocks.tsv"), dir.path().join("m1.blocks.tsv"));
    std::fs::write(&a, records_marked()).unwrap();
    std::fs::write(&b, records_marked_later()).unwrap();
    let out = Command::new("python3")
        .arg(script("timeline_phases.py"))
        .arg(format!("0={}", a.display()))
        .arg(format!("1={}", b.display()))
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "timeline_phases.py failed: {}", String::from_utf8_lossy(&out.stderr));
    let out = String::from_utf8(out.stdout).expect("UTF-8 output");
    assert!(out.lines().next().is_some_and(|h| h.contains("mark 0") && h.contains("mark 1")), "{out}");
    let row = out.lines().find(|l| l.starts_with("k ")).unwrap_or_else(|| panic!("no row for k in:\n{out}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    // kernel, grid, launches; wait to mark in the first file (1, 1, 3, 2, 2 us) and the second
    // (4 us each); the working blocks' mean end after their wait (8, 8, 12, 6, 6, 6 us) and the last
    // end after the first wait.
    assert_eq!(cols[1..], ["8", "1", "1.80", "4.00", "7.67", "12.00"], "{cols:?}");
}

/// A launch table (`CHERENKOV_TIMELINE`'s `.tsv`) of four launches: `b` twice, after `a` and after
/// `c`, with different grids.
fn launch_table() -> String {
    let mut s = String::from("# a launch table made up for the test\n");
    s += "launch\tkernel\tblocks\tstart\twaited\twaited_last\tend\tgap\town\tadded\n";
    for row in [
        "0\ta\t10\t0.00\t0.10\t0.20\t2.00\t0.10\t1.90\t2.00",
        "1\tb\t320\t1.00\t2.50\t2.60\t7.50\t0.50\t5.00\t5.50",
        "2\tc\t48\t6.00\t8.00\t8.00\t10.00\t0.50\t2.00\t2.50",
        "3\tb\t320\t9.00\t10.50\t10.60\t13.50\t0.50\t3.00\t3.50",
    ] {
        s += row;
        s += "\n";
    }
    s
}

#[test]
fn the_kernels_script_splits_a_kernel_by_grid_and_predecessor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tl-step1.tsv");
    std::fs::write(&path, launch_table()).unwrap();
    let run = |split: bool| {
        let mut cmd = Command::new("python3");
        cmd.arg(script("timeline_kernels.py"));
        if split {
            cmd.arg("--split");
        }
        let out = cmd.arg(&path).output().expect("python3 runs");
        assert!(out.status.success(), "timeline_kernels.py failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("UTF-8 output")
    };
    let cols = |out: &str, name: &str| -> Vec<String> {
        let row =
            out.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("no {name} in:\n{out}"));
        row.split_whitespace().map(str::to_string).collect()
    };
    // Together: 2 launches, own 8, added 9, 4.5 a launch; the step ends at 13.5 us.
    let whole = run(false);
    assert_eq!(cols(&whole, "b")[1..], ["2", "8.00", "9.00", "4.50"], "{whole}");
    assert!(whole.contains("step 13.5 us"), "{whole}");
    // Apart: after a, and after c.
    let split = run(true);
    assert_eq!(cols(&split, "b/320<a")[1..], ["1", "5.00", "5.50", "5.50"], "{split}");
    assert_eq!(cols(&split, "b/320<c")[1..], ["1", "3.00", "3.50", "3.50"], "{split}");
    assert_eq!(cols(&split, "a/10<-")[1], "1", "{split}");
}

/// `tools/gpu/timeline.sh` with a stand-in binary that writes [`launch_table`] for every step it is
/// asked to time: a warm-up run, then one run a variant with its own settings, each step's table
/// kept under the variant's name and summarised.
#[test]
fn the_timeline_runner_keeps_and_summarises_each_variants_steps() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("table.tsv"), launch_table()).unwrap();
    let bin = dir.path().join("cherenkov");
    let seen = dir.path().join("seen.txt");
    std::fs::write(
        &bin,
        format!(
            "#!/usr/bin/env bash\necho \"X=${{X:-}}\" >> {seen}\nfor s in ${{CHERENKOV_TIMELINE_STEP//,/ }}; do cp {table} \"$CHERENKOV_TIMELINE-step$s.tsv\"; done\n",
            seen = seen.display(),
            table = dir.path().join("table.tsv").display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out_dir = dir.path().join("tl");
    let out = Command::new("bash")
        .arg(script("timeline.sh"))
        .args(["-s", "1,2", "-g", "^b/", "new", "other:X=7"])
        .env("BIN", &bin)
        .env("OUT", &out_dir)
        .env("CHERENKOV_HOME", dir.path().join("home"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for (name, step) in [("new", 1), ("new", 2), ("other", 1), ("other", 2)] {
        assert!(text.contains(&format!("== {name}, step {step}")), "{text}");
        assert!(out_dir.join(format!("{name}-step{step}.tsv")).exists(), "{name} step {step}");
    }
    // Only the lines asked for, and each step's length.
    assert_eq!(text.matches("b/320<a ").count(), 4, "{text}");
    assert_eq!(text.matches("step 13.5 us").count(), 4, "{text}");
    assert!(!text.contains("a/10<-"), "{text}");
    // The warm-up and `new` without settings, `other` with its own.
    assert_eq!(std::fs::read_to_string(&seen).unwrap(), "X=\nX=\nX=7\n");
}

/// A streamed step's launch table of two MoE blocks: each a head kernel, the block's router, the
/// lookahead's router, an expert launch and the combination (ends in us: block 1's router at 10,
/// its combination at 40; block 2's router at 55, its combination at 95).
fn streamed_table() -> String {
    let mut s = String::from("# a streamed step made up for the test\n");
    s += "launch\tkernel\tblocks\tstart\twaited\twaited_last\tend\tgap\town\tadded\n";
    for (i, (kernel, end)) in [
        ("embed_row", 2.0),
        ("route_topk", 10.0),
        ("route_topk", 14.0),
        ("expert_gate_up_q4", 30.0),
        ("moe_combine", 40.0),
        ("matvec_many", 50.0),
        ("route_topk", 55.0),
        ("route_topk", 60.0),
        ("expert_down_q4", 90.0),
        ("moe_combine", 95.0),
    ]
    .into_iter()
    .enumerate()
    {
        s += &format!("{i}\t{kernel}\t1\t0\t0\t0\t{end:.2}\t0\t0\t0\n");
    }
    s + "\n# totals\n"
}

#[test]
fn the_heads_and_tails_script_splits_each_block_at_its_router() {
    let out = output_of("timeline_heads_tails.py", "tl-step1.tsv", &streamed_table());
    // Block 2's head: 40 to 55; the first block's is left out. Tails: 10 to 40, 55 to 95.
    assert!(out.contains("step 95 us, 2 blocks, heads 15 us, tails 70 us"), "{out}");
    assert!(out.contains("tails: 30.0 40.0"), "{out}");
}

/// A `CHERENKOV_FLAG_BLOCKS` table (the header as `CudaModel` writes it): model 0, two steps of
/// two blocks. Step 0: a block with a demand miss (waits 40 us), then one whose only missing
/// expert was a prefetch still copying (waits 10 us), 20 us of head between them. Step 1: a block
/// the router found whole (waits 2 us), then one whose missing expert had landed (no stamps of its
/// wait: "-"). A row of another width (a truncated write) is skipped.
fn flag_table() -> String {
    let header = cherenkov_cuda::model::FLAG_ROW_HEADER;
    let rows = [
        "0\t0\t0\t1\t0\t1\t1\t2\t80\t12\t20\t35\t38\t45\t0\t10\t50\t60",
        "0\t0\t1\t0\t1\t1\t1\t1\t70\t6\t10\t25\t28\t35\t80\t90\t100\t110",
        "0\t1\t0\t0\t0\t0\t0\t2\t90\t5\t8\t20\t23\t30\t0\t15\t17\t25",
        "0\t1\t1\t0\t0\t1\t0\t0\t60\t7\t11\t22\t25\t31\t40\t-\t-\t70",
        "0\t1\t2\t0",
    ];
    format!("{header}\n{}\n", rows.join("\n"))
}

#[test]
fn the_flag_blocks_script_puts_each_block_in_its_class() {
    let out = output_of("flag_blocks.py", "flags.tsv", &flag_table());
    let row = |class: &str| -> Vec<String> {
        let line = out.lines().find(|l| l.starts_with(class)).unwrap_or_else(|| panic!("no {class} row in:\n{out}"));
        line.split_whitespace().map(str::to_string).collect()
    };
    assert!(out.contains("model 0: 4 blocks in 2 steps"), "{out}");
    // class, blocks, share, wait, experts' span, head before the next block, lease, flags, reads
    // queued, prefetches a block.
    assert_eq!(row("misses")[1..], ["1", "25.0%", "40.0", "60.0", "20.0", "12.0", "20.0", "35.0", "2.00"]);
    assert_eq!(row("prefetched")[1..], ["1", "25.0%", "10.0", "30.0", "-", "6.0", "10.0", "25.0", "1.00"]);
    assert_eq!(row("found")[1..], ["1", "25.0%", "2.0", "25.0", "15.0", "5.0", "8.0", "20.0", "2.00"]);
    assert_eq!(row("landed")[1..4], ["1", "25.0%", "-"]);
    // 40 + 10 + 2 us over 2 steps.
    assert!(out.contains("GPU wait for flags: 0.026 ms a step"), "{out}");
    // Each step's second block came after a turn that queued 2 reads; neither had a miss, and the
    // second step's has no stamps: one wait of 10 us.
    let by: Vec<Vec<&str>> = out
        .lines()
        .skip_while(|l| !l.starts_with("wait by"))
        .skip(2)
        .take_while(|l| !l.is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(by, [["0", "2", "2", "10.0"]], "{out}");
    // The last step only: the found and landed blocks.
    let out = output_with("flag_blocks.py", &["--last", "1"], "flags.tsv", &flag_table());
    assert!(out.contains("model 0: 2 blocks in 1 steps") && !out.lines().any(|l| l.starts_with("misses ")), "{out}");
}
