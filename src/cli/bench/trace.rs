//! Request traces: Mooncake JSONL and Azure LLM inference CSV, plain or gzip-compressed.
//! The four public traces ship with the binary ([`BUNDLED`]; sources and licences in
//! `data/traces/README.md`).
//!
//! - **Mooncake** (`*.jsonl`), one object per line: `timestamp` (ms from the trace start),
//!   `input_length`, `output_length` (tokens), `hash_ids` (one id per 512-token block of the
//!   prompt; equal ids mean equal blocks).
//! - **Azure** (`*.csv`): header `TIMESTAMP,ContextTokens,GeneratedTokens` (any column order),
//!   timestamps `YYYY-MM-DD HH:MM:SS[.fraction]`; no prefix information.
//!
//! Both become [`TraceRecord`]s in time order, with timestamps in ms relative to the earliest
//! record.

use anyhow::{Context, bail};
use serde::Deserialize;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Tokens per Mooncake `hash_id` block.
pub const MOONCAKE_BLOCK: u32 = 512;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRecord {
    /// Arrival, ms from the first record of the trace.
    pub timestamp_ms: f64,
    /// Prompt length (tokens).
    pub input_tokens: u32,
    /// Completion length (tokens).
    pub output_tokens: u32,
    /// Mooncake block ids (one per 512 prompt tokens); empty for Azure.
    pub hash_ids: Vec<u64>,
}

/// Which trace format a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceFormat {
    /// Mooncake JSONL.
    Mooncake,
    /// Azure LLM inference CSV.
    Azure,
}

/// The format of `path`: by extension (`.jsonl`/`.json` → Mooncake, `.csv` → Azure), else by
/// the first character of `text` (`{` → Mooncake).
pub fn detect_format(path: &Path, text: &str) -> TraceFormat {
    match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl" | "json") => TraceFormat::Mooncake,
        Some("csv") => TraceFormat::Azure,
        _ if text.trim_start().starts_with('{') => TraceFormat::Mooncake,
        _ => TraceFormat::Azure,
    }
}

/// The public traces, gzip-compressed and embedded in the binary (so `bench --dataset` works
/// from any working directory and after `cargo install`): file name (without `.gz`) and bytes.
pub const BUNDLED: [(&str, &[u8]); 4] = [
    (
        "mooncake_conversation_trace.jsonl",
        include_bytes!("../../../data/traces/mooncake_conversation_trace.jsonl.gz"),
    ),
    (
        "mooncake_synthetic_trace.jsonl",
        include_bytes!("../../../data/traces/mooncake_synthetic_trace.jsonl.gz"),
    ),
    (
        "azure_llm_2023_conv.csv",
        include_bytes!("../../../data/traces/azure_llm_2023_conv.csv.gz"),
    ),
    (
        "azure_llm_2023_code.csv",
        include_bytes!("../../../data/traces/azure_llm_2023_code.csv.gz"),
    ),
];

/// Read and parse the trace at `path`: plain, or gzip when the name ends in `.gz`. The format
/// comes from the name without `.gz` (see [`detect_format`]).
///
/// # Errors
/// `path` cannot be read, decompressed or parsed (see [`parse_mooncake`],
/// [`parse_azure`]; `bad` says whether a malformed line stops it).
pub fn load(path: &Path, bad: &mut BadLines) -> anyhow::Result<(TraceFormat, Vec<TraceRecord>)> {
    let bytes =
        std::fs::read(path).with_context(|| format!("cannot read trace {}", path.display()))?;
    parse_file(path, &bytes, bad).with_context(|| format!("trace {}", path.display()))
}

/// The bundled trace `file` (a name of [`BUNDLED`], e.g. `azure_llm_2023_conv.csv`).
///
/// # Errors
/// No bundled trace is named `file`.
pub fn load_bundled(file: &str) -> anyhow::Result<(TraceFormat, Vec<TraceRecord>)> {
    let (name, gz) = BUNDLED
        .iter()
        .find(|(name, _)| *name == file)
        .with_context(|| format!("no bundled trace named {file}"))?;
    parse_file(
        Path::new(&format!("{name}.gz")),
        gz,
        &mut BadLines::default(),
    )
    .with_context(|| format!("bundled trace {name}"))
}

/// Parse the bytes of a trace file named `name` (gzip when it ends in `.gz`).
fn parse_file(
    name: &Path,
    bytes: &[u8],
    bad: &mut BadLines,
) -> anyhow::Result<(TraceFormat, Vec<TraceRecord>)> {
    let (name, text) = if name.extension().is_some_and(|e| e == "gz") {
        let mut text = String::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_string(&mut text)
            .context("cannot decompress (gzip, UTF-8)")?;
        (name.with_extension(""), text)
    } else {
        let text = std::str::from_utf8(bytes).context("not UTF-8")?;
        (name.to_owned(), text.to_owned())
    };
    let format = detect_format(&name, &text);
    let records = match format {
        TraceFormat::Mooncake => parse_mooncake(&text, bad),
        TraceFormat::Azure => parse_azure(&text, bad),
    }?;
    Ok((format, records))
}

/// A trace's short name: the file name without `.gz` and its format extension
/// (`x/mooncake_conversation_trace.jsonl.gz` → `mooncake_conversation_trace`).
pub fn trace_name(path: &Path) -> String {
    let path: PathBuf = if path.extension().is_some_and(|e| e == "gz") {
        path.with_extension("")
    } else {
        path.to_owned()
    };
    path.file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("trace")
        .to_owned()
}

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// What a parser does with a malformed line: stop on it (the default), or skip and count it
/// (`--skip-bad-lines`).
#[derive(Debug, Default)]
pub struct BadLines {
    /// Skip malformed lines instead of stopping.
    pub skip: bool,
    /// The lines skipped, each with why (`line 7: …`), in file order.
    pub skipped: Vec<String>,
}

impl BadLines {
    /// Skip malformed lines, counting them.
    pub fn skipping() -> Self {
        Self {
            skip: true,
            skipped: Vec::new(),
        }
    }

    /// A malformed line: `Ok` (recorded) when skipping, else the error.
    fn bad(&mut self, e: anyhow::Error) -> anyhow::Result<()> {
        if self.skip {
            self.skipped.push(format!("{e:#}"));
            Ok(())
        } else {
            Err(e)
        }
    }

    /// One line for the operator: how many lines were skipped, and the first few.
    pub fn summary(&self) -> Option<String> {
        const SHOWN: usize = 3;
        let n = self.skipped.len();
        (n > 0).then(|| {
            let first: Vec<&str> = self
                .skipped
                .iter()
                .take(SHOWN)
                .map(String::as_str)
                .collect();
            format!(
                "skipped {n} malformed trace line{} (--skip-bad-lines): {}{}",
                if n == 1 { "" } else { "s" },
                first.join("; "),
                if n > SHOWN { "; …" } else { "" }
            )
        })
    }
}

/// Parse Mooncake JSONL (blank lines skipped); records sorted by time, timestamps made relative to the earliest.
///
/// # Errors
/// A non-blank line is not a Mooncake record (the error names the line), unless `bad` skips
/// it.
pub fn parse_mooncake(text: &str, bad: &mut BadLines) -> anyhow::Result<Vec<TraceRecord>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: MooncakeLine = match serde_json::from_str(line) {
            Ok(l) => l,
            Err(e) => {
                bad.bad(anyhow::Error::new(e).context(format!("line {}", i + 1)))?;
                continue;
            }
        };
        out.push(TraceRecord {
            timestamp_ms: l.timestamp,
            input_tokens: l.input_length,
            output_tokens: l.output_length,
            hash_ids: l.hash_ids,
        });
    }
    rebase(&mut out);
    Ok(out)
}

/// Parse an Azure LLM inference CSV; records sorted by time, timestamps made relative to the earliest.
///
/// # Errors
/// The CSV is empty or malformed, lacks one of the three columns, or a row has too
/// few fields, a bad token count or a bad timestamp (the error names the line; `bad` may skip
/// such a row).
pub fn parse_azure(text: &str, bad: &mut BadLines) -> anyhow::Result<Vec<TraceRecord>> {
    let mut rd = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .flexible(true)
        .from_reader(text.as_bytes());
    let header = rd.headers().context("CSV header")?.clone();
    if header.is_empty() {
        bail!("empty CSV");
    }
    let col = |name: &str| {
        header
            .iter()
            .position(|c| c.eq_ignore_ascii_case(name))
            .with_context(|| {
                format!(
                    "CSV header has no column {name}: {}",
                    header.iter().collect::<Vec<_>>().join(",")
                )
            })
    };
    let (ts, ctx, gen_col) = (
        col("TIMESTAMP")?,
        col("ContextTokens")?,
        col("GeneratedTokens")?,
    );
    let newlines: Vec<usize> = text
        .bytes()
        .enumerate()
        .filter(|&(_, b)| b == b'\n')
        .map(|(i, _)| i)
        .collect();
    // A record's position may point at the line break before it (csv's reader treats "\r\n"
    // as two terminators, and skips blank lines): step over breaks to its first byte.
    let bytes = text.as_bytes();
    let line_at = |byte: usize| {
        let first = bytes
            .get(byte..)
            .and_then(|rest| rest.iter().position(|b| !matches!(b, b'\r' | b'\n')))
            .map_or(bytes.len(), |k| byte + k);
        newlines.partition_point(|&nl| nl < first) + 1
    };
    let mut out = Vec::new();
    for row in rd.records() {
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                let at = e.position().map_or_else(
                    || "CSV".to_owned(),
                    |p| format!("line {}", line_at(p.byte() as usize)),
                );
                bad.bad(anyhow::Error::new(e).context(at))?;
                continue;
            }
        };
        // The file line of the row, from its byte offset (csv's own line count drifts on
        // CRLF files and after blank lines).
        let line = row.position().map_or(0, |p| line_at(p.byte() as usize));
        let field = |k: usize| {
            row.get(k)
                .with_context(|| format!("line {line}: too few columns"))
        };
        let num = |k: usize| -> anyhow::Result<u32> {
            let s = field(k)?;
            s.parse()
                .with_context(|| format!("line {line}: not a token count: {s}"))
        };
        let record = || -> anyhow::Result<TraceRecord> {
            Ok(TraceRecord {
                timestamp_ms: parse_datetime_s(field(ts)?)
                    .with_context(|| format!("line {line}"))?
                    * 1000.0,
                input_tokens: num(ctx)?,
                output_tokens: num(gen_col)?,
                hash_ids: Vec::new(),
            })
        };
        match record() {
            Ok(r) => out.push(r),
            Err(e) => bad.bad(e)?,
        }
    }
    rebase(&mut out);
    Ok(out)
}

/// Put the records in time order (stable: equal times keep the file's order) and make their
/// timestamps relative to the earliest (which becomes 0). A trace whose lines are not in time
/// order, or start below 0, replays as the times say.
fn rebase(records: &mut [TraceRecord]) {
    records.sort_by(|a, b| a.timestamp_ms.total_cmp(&b.timestamp_ms));
    if let Some(t0) = records.first().map(|r| r.timestamp_ms) {
        for r in records.iter_mut() {
            r.timestamp_ms -= t0;
        }
    }
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` (or with a `T`, optionally ending in `Z`), read as UTC →
/// seconds since 1970-01-01 UTC.
///
/// # Errors
/// `s` is not such a date-time.
pub fn parse_datetime_s(s: &str) -> anyhow::Result<f64> {
    let t: jiff::civil::DateTime = s
        .strip_suffix('Z')
        .unwrap_or(s)
        .parse()
        .with_context(|| format!("not a date-time: {s}"))?;
    let t = jiff::tz::TimeZone::UTC
        .to_timestamp(t)
        .with_context(|| format!("not a date-time: {s}"))?;
    Ok(t.as_second() as f64 + f64::from(t.subsec_nanosecond()) * 1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines() {
        let text = r#"{"timestamp": 1000, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}

{"timestamp": 4000, "input_length": 12, "output_length": 1, "hash_ids": [0]}
"#;
        let r = parse_mooncake(text, &mut BadLines::default()).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].timestamp_ms, 0.0);
        assert_eq!(r[1].timestamp_ms, 3000.0);
        assert_eq!(r[0].input_tokens, 700);
        assert_eq!(r[0].hash_ids, vec![0, 1]);
        assert_eq!(r[1].output_tokens, 1);
        let err = parse_mooncake("{\"timestamp\": 0}\n", &mut BadLines::default()).unwrap_err();
        assert!(format!("{err:#}").contains("line 1"), "{err:#}");
    }

    #[test]
    fn azure_csv() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:15:46.6805900,374,44\n\
                    2023-11-16 18:15:50.9951690,396,109\n\
                    2023-11-17 00:00:00,1,2\n";
        let r = parse_azure(text, &mut BadLines::default()).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].timestamp_ms, 0.0);
        assert!(
            (r[1].timestamp_ms - 4314.579).abs() < 1e-3,
            "{}",
            r[1].timestamp_ms
        );
        // Across midnight: 18:15:46.68 → 00:00:00 next day = 20,653.32 s.
        assert!((r[2].timestamp_ms - 20_653_319.41).abs() < 1e-2);
        assert_eq!((r[1].input_tokens, r[1].output_tokens), (396, 109));
        assert!(r[0].hash_ids.is_empty());
        assert!(parse_azure("a,b\n1,2\n", &mut BadLines::default()).is_err());
        assert!(
            parse_azure(
                "TIMESTAMP,ContextTokens,GeneratedTokens\nx,1,2\n",
                &mut BadLines::default()
            )
            .is_err()
        );
    }

    #[test]
    fn bad_lines_stop_the_parse_or_are_skipped_and_counted() {
        let text = "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n\
                    not json\n\
                    {\"timestamp\": 10}\n\
                    {\"timestamp\": 20, \"input_length\": 6, \"output_length\": 2}\n";
        let err = parse_mooncake(text, &mut BadLines::default()).unwrap_err();
        assert!(format!("{err:#}").starts_with("line 2:"), "{err:#}");
        let mut bad = BadLines::skipping();
        let r = parse_mooncake(text, &mut bad).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].input_tokens, 6);
        assert_eq!(bad.skipped.len(), 2);
        assert!(bad.skipped[1].starts_with("line 3:"), "{:?}", bad.skipped);
        let summary = bad.summary().unwrap();
        assert!(
            summary.starts_with("skipped 2 malformed trace lines"),
            "{summary}"
        );

        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                   2023-11-16 18:15:46,374,44\n\
                   2023-11-16 18:15:47,x,44\n\
                   2023-11-16 18:15:48\n\
                   2023-11-16 18:15:49,3,4\n";
        let err = parse_azure(csv, &mut BadLines::default()).unwrap_err();
        assert!(format!("{err:#}").contains("line 3"), "{err:#}");
        let mut bad = BadLines::skipping();
        let r = parse_azure(csv, &mut bad).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].timestamp_ms, 3000.0);
        assert_eq!(bad.skipped.len(), 2, "{:?}", bad.skipped);
        assert!(bad.skipped[1].contains("line 4"), "{:?}", bad.skipped);
        assert_eq!(BadLines::skipping().summary(), None);
    }

    /// Line numbers are the file's, on CRLF files and past blank lines; records out of time
    /// order (or below 0) are sorted and rebased to the earliest.
    #[test]
    fn csv_lines_are_named_as_the_file_numbers_them_and_records_are_sorted() {
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n\
                   2023-11-16 18:15:50,374,44\r\n\
                   2023-11-16 18:15:46,396,109\r\n\
                   2023-11-16 18:15:47,abc,10\n\
                   \n\
                   2023-11-16 18:15:48,100\n";
        let mut bad = BadLines::skipping();
        let r = parse_azure(csv, &mut bad).unwrap();
        assert_eq!(bad.skipped.len(), 2, "{:?}", bad.skipped);
        assert!(bad.skipped[0].starts_with("line 4:"), "{:?}", bad.skipped);
        assert!(bad.skipped[1].starts_with("line 6:"), "{:?}", bad.skipped);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].timestamp_ms, r[0].input_tokens), (0.0, 396));
        assert_eq!((r[1].timestamp_ms, r[1].input_tokens), (4000.0, 374));
        let m = "{\"timestamp\": 5000, \"input_length\": 1, \"output_length\": 1}\n\
                 {\"timestamp\": -1000, \"input_length\": 2, \"output_length\": 1}\n";
        let r = parse_mooncake(m, &mut BadLines::default()).unwrap();
        assert_eq!((r[0].timestamp_ms, r[0].input_tokens), (0.0, 2));
        assert_eq!(r[1].timestamp_ms, 6000.0);
    }

    #[test]
    fn epoch_and_format_detection() {
        assert_eq!(parse_datetime_s("1970-01-01 00:00:00").unwrap(), 0.0);
        assert_eq!(
            parse_datetime_s("2000-03-01T00:00:01Z").unwrap(),
            951_868_801.0
        );
        assert_eq!(
            detect_format(Path::new("a.jsonl"), ""),
            TraceFormat::Mooncake
        );
        assert_eq!(detect_format(Path::new("a.csv"), "{"), TraceFormat::Azure);
        assert_eq!(detect_format(Path::new("a"), " {"), TraceFormat::Mooncake);
    }

    /// The bundled traces: every record parses, and the ideal hit rate of the conversation
    /// trace that `data/traces/README.md` states (36.6 %) is reproduced.
    #[test]
    fn bundled_traces() {
        let (fmt, r) = load_bundled("mooncake_conversation_trace.jsonl").unwrap();
        assert_eq!(fmt, TraceFormat::Mooncake);
        assert_eq!(r.len(), 12_031);
        let rate = crate::cli::bench::workload::trace_block_hit_rate(&r);
        assert!((rate - 0.366).abs() < 0.001, "{rate}");
        let (_, s) = load_bundled("mooncake_synthetic_trace.jsonl").unwrap();
        assert_eq!(s.len(), 3_993);
        let (fmt, a) = load_bundled("azure_llm_2023_conv.csv").unwrap();
        assert_eq!(fmt, TraceFormat::Azure);
        assert_eq!(a.len(), 19_366);
        let (_, c) = load_bundled("azure_llm_2023_code.csv").unwrap();
        assert_eq!(c.len(), 8_819);
        assert!(load_bundled("nope.csv").is_err());
    }

    /// A trace file on disk, plain or gzip: the same records; a missing file's error names it.
    #[test]
    fn files_plain_and_gzip() {
        use std::io::Write;
        let text = "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1, 2]}\n";
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("t.jsonl");
        std::fs::write(&plain, text).unwrap();
        let gz = dir.path().join("t.jsonl.gz");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(text.as_bytes()).unwrap();
        std::fs::write(&gz, enc.finish().unwrap()).unwrap();
        let a = load(&plain, &mut BadLines::default()).unwrap();
        let b = load(&gz, &mut BadLines::default()).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.0, TraceFormat::Mooncake);
        assert_eq!(a.1[0].hash_ids, vec![1, 2]);
        assert_eq!(trace_name(&gz), "t");
        assert_eq!(trace_name(&plain), "t");
        let missing = dir.path().join("missing.csv");
        let e = format!(
            "{:#}",
            load(&missing, &mut BadLines::default()).unwrap_err()
        );
        assert!(e.contains(&missing.display().to_string()), "{e}");
    }
}
