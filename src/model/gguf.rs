//! GGUF container parser (versions 2 and 3): header, metadata key/values, tensor infos and
//! the aligned tensor-data section, read from a memory map.
//!
//! Layout (ggml `docs/gguf.md`): magic `GGUF`, u32 version, u64 tensor count, u64 metadata
//! count, metadata pairs, tensor infos (name, n_dims, dims fastest-first, u32 type, u64 offset),
//! padding to `general.alignment` (default 32), then tensor data. Every read is bounds-checked:
//! a truncated or corrupt file gives a [`GgufError`], never a panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

/// Errors while reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open GGUF file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a GGUF file (magic {0:?}, expected \"GGUF\")")]
    BadMagic([u8; 4]),
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("GGUF file truncated or corrupt: {0}")]
    Truncated(String),
    #[error("unknown GGUF metadata value type {0}")]
    UnknownValueType(u32),
    #[error("unknown ggml tensor type {ty} for tensor {tensor}")]
    UnknownDtype { tensor: String, ty: u32 },
    #[error("ggml tensor type {dtype:?} of tensor {tensor} is not supported")]
    UnsupportedDtype { tensor: String, dtype: GgmlType },
    #[error("tensor {0} not found in GGUF file")]
    MissingTensor(String),
    #[error("metadata key {0} missing or of the wrong type")]
    MissingKey(String),
    #[error("tensor {tensor} has shape {shape:?}, expected {expected:?}")]
    BadShape {
        tensor: String,
        shape: Vec<usize>,
        expected: Vec<usize>,
    },
}

/// ggml tensor element types (values from ggml.h `enum ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    BF16,
}

impl GgmlType {
    /// Maps the on-disk u32 to a type; `None` for ids we do not know at all.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block), from ggml's type traits.
    pub fn block_layout(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q8_1 => (32, 36),
            Self::Q2K => (256, 84),
            Self::Q3K => (256, 110),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
            Self::Q8K => (256, 292),
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Integer value of any integer type (negative values give `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// Float value of a float or integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's header entry.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions fastest-first, as in the file (`[in, out]` for a weight matrix).
    pub dims: Vec<usize>,
    pub dtype: GgmlType,
    /// Byte offset inside the data section.
    pub offset: usize,
    /// Byte length of the data.
    pub len: usize,
}

/// An opened GGUF file: parsed header plus the memory map holding the tensor bytes.
pub struct GgufFile {
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: HashMap<String, TensorInfo>,
    data_start: usize,
    mmap: Mmap,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(GgufError::Truncated(format!(
                "reading {what} at byte {} (+{n}) past end of file ({} bytes)",
                self.pos,
                self.buf.len()
            ))),
        }
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    fn len(&mut self, what: &str) -> Result<usize, GgufError> {
        let v = self.u64(what)?;
        // Any count larger than the file cannot be honest.
        usize::try_from(v)
            .ok()
            .filter(|&n| n <= self.buf.len())
            .ok_or_else(|| GgufError::Truncated(format!("{what}: implausible length {v}")))
    }
    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.len(what)?;
        let b = self.take(n, what)?;
        Ok(String::from_utf8_lossy(b).into_owned())
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue, GgufError> {
        let w = "metadata value";
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>(w)?[0]),
            1 => MetaValue::I8(self.arr::<1>(w)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr(w)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr(w)?)),
            4 => MetaValue::U32(self.u32(w)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr(w)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr(w)?)),
            7 => MetaValue::Bool(self.arr::<1>(w)?[0] != 0),
            8 => MetaValue::String(self.string(w)?),
            9 => {
                if depth > 4 {
                    return Err(GgufError::Truncated("nested arrays too deep".into()));
                }
                let inner = self.u32(w)?;
                let n = self.len("array length")?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64(w)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr(w)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr(w)?)),
            other => return Err(GgufError::UnknownValueType(other)),
        })
    }
}

impl GgufFile {
    /// Opens and parses `path`. Tensor data stays in the memory map until read.
    ///
    /// # Errors
    /// [`GgufError::Io`] when the file cannot be opened or mapped; [`GgufError::BadMagic`],
    /// [`GgufError::UnsupportedVersion`], [`GgufError::Truncated`] or
    /// [`GgufError::UnknownValueType`] when it is not a GGUF file this parser reads.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; the model file is not modified while the process runs
        // (the same assumption every mmap-based loader makes).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(mmap)
    }

    fn parse(mmap: Mmap) -> Result<Self, GgufError> {
        let mut r = Reader { buf: &mmap, pos: 0 };
        let magic: [u8; 4] = r.arr("magic")?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic(magic));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.len("tensor count")?;
        let n_kv = r.len("metadata count")?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata type")?;
            let v = r.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let nd = r.u32("n_dims")? as usize;
            if nd > 4 {
                return Err(GgufError::Truncated(format!("tensor {name}: {nd} dims")));
            }
            let mut dims = Vec::with_capacity(nd);
            for _ in 0..nd {
                dims.push(r.len("tensor dim")?);
            }
            let ty = r.u32("tensor type")?;
            let dtype = GgmlType::from_u32(ty).ok_or_else(|| GgufError::UnknownDtype {
                tensor: name.clone(),
                ty,
            })?;
            let offset = r.len("tensor offset")?;
            infos.push((name, dims, dtype, offset));
        }
        let align = metadata
            .get("general.alignment")
            .and_then(MetaValue::as_u64)
            .unwrap_or(32) as usize;
        if align == 0 || !align.is_power_of_two() {
            return Err(GgufError::Truncated(format!("bad alignment {align}")));
        }
        let data_start = r.pos.div_ceil(align) * align;
        let data_len = mmap.len().saturating_sub(data_start);
        let mut tensors = HashMap::new();
        for (name, dims, dtype, offset) in infos {
            let n: usize = dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| {
                    GgufError::Truncated(format!("tensor {name}: element count overflows"))
                })?;
            let (be, bb) = dtype.block_layout();
            if !n.is_multiple_of(be) {
                return Err(GgufError::Truncated(format!(
                    "tensor {name}: {n} elements not a multiple of block size {be}"
                )));
            }
            let len = n / be * bb;
            if offset.checked_add(len).is_none_or(|e| e > data_len) {
                return Err(GgufError::Truncated(format!(
                    "tensor {name} (bytes {offset}..{}) lies past the end of the data section ({data_len} bytes)",
                    offset.saturating_add(len)
                )));
            }
            let info = TensorInfo {
                name: name.clone(),
                dims,
                dtype,
                offset,
                len,
            };
            tensors.insert(name, info);
        }
        Ok(Self {
            version,
            metadata,
            tensors,
            data_start,
            mmap,
        })
    }

    /// The raw bytes of a tensor (bounds were checked at parse time).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let s = self.data_start + info.offset;
        &self.mmap[s..s + info.len]
    }

    /// Looks a tensor up by name.
    ///
    /// # Errors
    /// [`GgufError::MissingTensor`] when no tensor has that name.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }
    ///
    /// # Errors
    /// When the key is absent or not an integer.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get(key)
            .and_then(MetaValue::as_u64)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }
    ///
    /// # Errors
    /// When the key is absent or not a number.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        self.get(key)
            .and_then(MetaValue::as_f64)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }
    ///
    /// # Errors
    /// When the key is absent or not a string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.get(key)
            .and_then(MetaValue::as_str)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_tmp(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        f.write_all(bytes).expect("write");
        f
    }

    fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b
    }

    #[test]
    fn bad_magic_is_typed() {
        let f = write_tmp(b"GGML\x03\0\0\0");
        assert!(matches!(
            GgufFile::open(f.path()),
            Err(GgufError::BadMagic(_))
        ));
    }

    #[test]
    fn truncated_header_is_typed() {
        let f = write_tmp(&header(1, 1)[..14]);
        assert!(matches!(
            GgufFile::open(f.path()),
            Err(GgufError::Truncated(_))
        ));
    }

    #[test]
    fn unknown_dtype_is_typed() {
        let mut b = header(1, 0);
        b.extend(1u64.to_le_bytes());
        b.push(b'w');
        b.extend(1u32.to_le_bytes());
        b.extend(32u64.to_le_bytes());
        b.extend(99u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        let f = write_tmp(&b);
        assert!(matches!(
            GgufFile::open(f.path()),
            Err(GgufError::UnknownDtype { ty: 99, .. })
        ));
    }

    #[test]
    fn tensor_past_end_is_typed() {
        let mut b = header(1, 0);
        b.extend(1u64.to_le_bytes());
        b.push(b'w');
        b.extend(1u32.to_le_bytes());
        b.extend(64u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.resize(b.len().div_ceil(32) * 32 + 16, 0);
        let f = write_tmp(&b);
        assert!(matches!(
            GgufFile::open(f.path()),
            Err(GgufError::Truncated(_))
        ));
    }
}
