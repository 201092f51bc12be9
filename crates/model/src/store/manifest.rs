//! `manifest.json`: what a store holds and where.
//!
//! A store is a directory:
//! - `manifest.json`: this file.
//! - `dense.bin`: every non-expert tensor. Each part (data, or words / scales / biases of an affine
//!   tensor) starts on a 4 KiB boundary so it can be mapped or uploaded without copying.
//! - `experts-<tag>.bin`: one record per (MoE layer, expert), record index `slot * E + expert`, each
//!   record `record_bytes` long (a multiple of 4 KiB) holding gate | up | down, each matrix as
//!   words | scales | biases (or bf16 data) at 256-byte aligned offsets given by the layer's
//!   [`ExpertLayout`]. One aligned read fetches one expert. Slots are the trunk layers in order,
//!   then the MTP layers.
//! - `experts-<tag>.sums`: the xxh3-64 of every record, little-endian u64 in record order; readers
//!   check a record against it after every read.
//! - `experts-<tag>.psums` (optional; stores packed before it lack it): the xxh3-64 of every piece
//!   of every record (pieces of `piece_bytes`, the last one shorter), record-major, so a reader can
//!   read and check a record's pieces in parallel.
//! - `ngram.bin`: per PLE layer a table of rows, row-major; an affine row is words | scales | biases
//!   of that row, so one row is one contiguous slice.
//! - tokenizer and chat-template files copied from the checkpoint.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::checkpoint::Layout;
use crate::config::TextConfig;
use crate::dtype::DType;
use crate::quant::Affine;

pub const FORMAT: &str = "cherenkov-store";
pub const FORMAT_VERSION: u32 = 1;
pub const DENSE_ALIGN: u64 = 4096;
pub const RECORD_ALIGN: u64 = 4096;
pub const PART_ALIGN: u64 = 256;

/// How a tensor's elements are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Precision {
    /// Plain floats (norms, convolutions, narrow linears).
    Float { dtype: DType },
    /// MLX affine: u32 words, bf16 scales and biases.
    Affine { bits: u32, group_size: usize },
}

impl Precision {
    pub fn affine(&self) -> Option<Affine> {
        match *self {
            Precision::Affine { bits, group_size } => Some(Affine::new(bits, group_size)),
            Precision::Float { .. } => None,
        }
    }

    pub fn from_affine(a: Affine) -> Precision {
        Precision::Affine { bits: a.bits, group_size: a.group_size }
    }

    /// Bytes of one row of `cols` weights.
    pub fn row_bytes(&self, cols: usize) -> usize {
        match self {
            Precision::Float { dtype } => cols * dtype.size(),
            Precision::Affine { bits, group_size } => Affine::new(*bits, *group_size).row_bytes(cols),
        }
    }

    pub fn label(&self) -> String {
        match self {
            Precision::Float { dtype } => dtype.name().to_lowercase(),
            Precision::Affine { bits, group_size } => format!("q{bits}g{group_size}"),
        }
    }
}

/// A byte range of a file (or, inside an expert record, of the record).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub offset: u64,
    pub len: u64,
}

impl Span {
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset as usize..(self.offset + self.len) as usize
    }
}

/// A tensor in `dense.bin`. Affine tensors are `[rows, cols]` with `data` the words.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DenseTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub precision: Precision,
    pub data: Span,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scales: Option<Span>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub biases: Option<Span>,
}

impl DenseTensor {
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    pub fn rows(&self) -> usize {
        self.shape[..self.shape.len().saturating_sub(1)].iter().product()
    }
}

/// One matrix inside an expert record; spans are relative to the record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecordMatrix {
    /// `[out, in]`.
    pub shape: [usize; 2],
    pub precision: Precision,
    pub data: Span,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scales: Option<Span>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub biases: Option<Span>,
}

/// The record layout of one MoE layer: gate, up and down.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertLayout {
    /// `layers.3` or `mtp.layers.0`.
    pub layer: String,
    pub gate_proj: RecordMatrix,
    pub up_proj: RecordMatrix,
    pub down_proj: RecordMatrix,
}

impl ExpertLayout {
    pub fn matrices(&self) -> [&RecordMatrix; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }
    /// Bytes actually used in a record (before padding).
    pub fn used_bytes(&self) -> u64 {
        self.matrices()
            .iter()
            .map(|m| [Some(m.data), m.scales, m.biases].iter().flatten().map(|s| s.offset + s.len).max().unwrap_or(0))
            .max()
            .unwrap_or(0)
    }
}

/// Pieces a record is read and checked in, in parallel. A page-cache read runs at 6-7 GB/s per
/// thread on the H200 host, so a 2.64 MiB record needs many threads to be read in well under the
/// copy's 0.07 ms; stores packed with 4 pieces (before 2026-11-30) still read, in 4.
pub const RECORD_PIECES: u64 = 16;

/// Per-piece checksums of the expert records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PieceSums {
    pub file: String,
    /// Bytes per piece (a multiple of 4 KiB); the last piece of a record may be shorter.
    pub piece_bytes: u64,
}

impl PieceSums {
    /// The piece size for records of `record_bytes`.
    pub fn piece_bytes_for(record_bytes: u64) -> u64 {
        record_bytes.div_ceil(RECORD_PIECES).next_multiple_of(RECORD_ALIGN)
    }

    /// Pieces per record.
    pub fn pieces(&self, record_bytes: u64) -> usize {
        record_bytes.div_ceil(self.piece_bytes) as usize
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertFile {
    pub file: String,
    pub sums_file: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub piece_sums: Option<PieceSums>,
    pub record_bytes: u64,
    pub num_experts: usize,
    /// One layout per MoE layer slot (trunk layers, then MTP layers).
    pub layers: Vec<ExpertLayout>,
}

impl ExpertFile {
    pub fn records(&self) -> u64 {
        (self.layers.len() * self.num_experts) as u64
    }
    pub fn record_index(&self, slot: usize, expert: usize) -> u64 {
        (slot * self.num_experts + expert) as u64
    }
}

/// One PLE layer's n-gram table in `ngram.bin`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NgramTable {
    /// Decoder layer (zero-based).
    pub layer: usize,
    pub rows: u64,
    pub cols: usize,
    pub precision: Precision,
    /// Bytes per row (words | scales | biases for affine rows).
    pub row_bytes: u64,
    /// Offset of row 0 in `ngram.bin` (4 KiB aligned).
    pub offset: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NgramFile {
    pub file: String,
    pub tables: Vec<NgramTable>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileSum {
    pub bytes: u64,
    /// xxh3-64 of the whole file, hex.
    pub xxh3: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceInfo {
    /// The checkpoint directory packed.
    pub path: String,
    pub layout: Layout,
    /// Identity of the checkpoint (config, file names, sizes, headers).
    pub fingerprint: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub created_by: String,
    pub model_type: String,
    pub source: SourceInfo,
    pub config: TextConfig,
    /// MTP layers packed (0: the checkpoint has no MTP head).
    pub mtp_layers: usize,
    pub tensors: Vec<DenseTensor>,
    pub experts: ExpertFile,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ngram: Option<NgramFile>,
    /// Size and checksum of every file of the store except the manifest.
    pub files: BTreeMap<String, FileSum>,
}

impl Manifest {
    pub fn tensor(&self, name: &str) -> Option<&DenseTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}
