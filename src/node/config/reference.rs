//! The configuration reference (`flotilla config --reference`, committed as
//! `docs/config-reference.md`), generated from the configuration types so that it cannot
//! drift: every key of the tree by its dotted path, its type, its default, its unit and its
//! doc.
//!
//! The keys, types and docs come from the JSON schema `schemars` derives from the sections
//! (their `///` docs are the schema's descriptions; serde's names and `deny_unknown_fields`
//! are honoured); the defaults from [`Config::default`] as the loader seeds it; the unit from
//! the key's suffix (`_ms`, `_bytes`, …), else a section's `x-unit` schema extension, else a
//! unit the doc names in parentheses (`(ms)`).

use super::Config;
use serde_json::Value;
use std::fmt::Write as _;

/// The command that prints the reference; the test that compares it with the committed file
/// names it.
pub const COMMAND: &str = "cargo run -- config --reference > docs/config-reference.md";

/// Units by key suffix, longest first where they overlap.
const SUFFIX_UNITS: &[(&str, &str)] = &[
    ("_bytes_per_token", "bytes/token"),
    ("dollars_per_hour", "currency/hour"),
    ("_ms", "ms"),
    ("_us", "µs"),
    ("_s", "s"),
    ("_bytes", "bytes"),
    ("_gbps", "GB/s"),
    ("_tokens", "tokens"),
    ("_blocks", "blocks"),
    ("_intervals", "planner intervals"),
    ("_seqs", "sequences"),
    ("_replicas", "replicas"),
    ("_restarts", "restarts"),
];

/// Units a doc may name in parentheses, e.g. "… this long (ms)".
const DOC_UNITS: &[(&str, &str)] = &[
    ("(ms)", "ms"),
    ("(ms,", "ms"),
    ("(ms;", "ms"),
    ("(µs)", "µs"),
    ("(s)", "s"),
    ("(bytes)", "bytes"),
    ("(tokens)", "tokens"),
];

/// The reference, as Markdown (without a final newline).
pub fn markdown() -> String {
    let mut root = schemars::schema_for!(Config).to_value();
    let defs = root.get("$defs").cloned().unwrap_or(Value::Null);
    inline_refs(&mut root, &defs);
    let defaults = serde_json::to_value(Config::default()).unwrap_or(Value::Null);
    let mut blocks = vec![
        "# Configuration reference".to_string(),
        format!(
            "<!-- Generated from the configuration types by `flotilla config --reference`: do \
             not edit; regenerate with `{COMMAND}`. -->"
        ),
        "Every key of a node's configuration, section by section: its dotted path, type, \
         default, unit and what it does. How the sources combine (defaults, a TOML file, \
         `FLOTILLA_<SECTION>__<FIELD>` variables, `--set section.field=value` flags) and the \
         sections that need more than a field's doc are in \
         [`configuration.md`](configuration.md). In a TOML file a key `section.field` is \
         `field` under `[section]`; a list of tables (`router.external_workers[]`) is \
         `[[router.external_workers]]`, one per item."
            .to_string(),
    ];
    let sections = root
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    for (name, section) in &sections {
        blocks.push(format!("## `[{name}]`"));
        let doc = doc_of(section);
        blocks.extend(doc.clone());
        blocks.extend(type_doc_of(section).filter(|t| Some(t) != doc.as_ref()));
        let mut keys = Vec::new();
        walk(name, section, defaults.get(name), &mut keys);
        for k in keys {
            blocks.push(format!("### `{}`", k.path));
            let mut line = k.ty;
            if let Some(d) = k.default {
                let _ = write!(line, " · default {d}");
            }
            if let Some(u) = k.unit {
                let _ = write!(line, " · unit {u}");
            }
            blocks.push(line);
            blocks.extend(k.doc);
            blocks.extend(k.values);
        }
    }
    blocks.join("\n\n")
}

/// `schema` with every `{"$ref": "#/$defs/T"}` replaced by `T`'s schema from `defs`; a
/// description beside the reference (the field's doc) replaces `T`'s own, which is kept as
/// `x-type-doc`.
fn inline_refs(schema: &mut Value, defs: &Value) {
    match schema {
        Value::Object(m) => {
            if let Some(target) = m
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| r.strip_prefix("#/$defs/"))
                .and_then(|name| defs.get(name))
            {
                let mut inlined = target.clone();
                inline_refs(&mut inlined, defs);
                if let Value::Object(t) = &mut inlined {
                    if let Some(d) = t.remove("description") {
                        t.insert("x-type-doc".into(), d);
                    }
                    for (k, v) in m.iter().filter(|(k, _)| *k != "$ref") {
                        t.insert(k.clone(), v.clone());
                    }
                }
                *schema = inlined;
            } else {
                m.remove("$defs");
                for v in m.values_mut() {
                    inline_refs(v, defs);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|v| inline_refs(v, defs)),
        _ => {}
    }
}

/// One key of the reference.
struct Key {
    path: String,
    ty: String,
    /// `None` for a table (its keys have theirs).
    default: Option<String>,
    unit: Option<String>,
    doc: Option<String>,
    /// The docs of an enum's values.
    values: Option<String>,
}

/// The keys under a table `schema` at `path`, whose default value is `default` (`None`: the
/// items of a list, whose defaults are the schema's own).
fn walk(path: &str, schema: &Value, default: Option<&Value>, out: &mut Vec<Key>) {
    let Some(props) = schema.get("properties").and_then(Value::as_object) else {
        return;
    };
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for (field, s) in props {
        let key_path = format!("{path}.{field}");
        let value = match default {
            Some(d) => d.get(field),
            None => s.get("default"),
        };
        let inner = non_null(s);
        let table = inner.get("properties").is_some();
        let default_text = match value {
            _ if table => None,
            Some(v) => Some(render_default(field, v)),
            None if required.contains(&field.as_str()) => Some("none (required)".to_string()),
            None => Some("unset".to_string()),
        };
        out.push(Key {
            path: key_path.clone(),
            ty: type_of(s),
            default: default_text,
            unit: unit_of(field, s),
            doc: doc_of(s).or_else(|| type_doc_of(s)),
            values: values_doc(s),
        });
        if table {
            walk(&key_path, inner, value, out);
        } else if let Some(items) = inner.get("items")
            && items.get("properties").is_some()
        {
            walk(&format!("{key_path}[]"), items, None, out);
        }
    }
}

/// `schema` without the `null` of an optional value (`anyOf: [T, null]`).
fn non_null(schema: &Value) -> &Value {
    if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
        let rest: Vec<&Value> = any
            .iter()
            .filter(|s| s.get("type").and_then(Value::as_str) != Some("null"))
            .collect();
        if let [one] = rest.as_slice() {
            return one;
        }
    }
    schema
}

/// Whether `schema` also admits `null` (an optional value).
fn nullable(schema: &Value) -> bool {
    let in_types = |s: &Value| match s.get("type") {
        Some(Value::String(t)) => t == "null",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "null"),
        _ => false,
    };
    in_types(schema)
        || schema
            .get("anyOf")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(in_types))
}

/// The values an enum's schema allows, if it is one, each with its doc (a variant's `///`).
fn enum_values(schema: &Value) -> Option<Vec<(String, Option<String>)>> {
    let plain = |s: &Value| -> Option<Vec<(String, Option<String>)>> {
        let doc = s
            .get("description")
            .and_then(Value::as_str)
            .map(plain_links);
        if let Some(c) = s.get("const") {
            return Some(vec![(c.to_string(), doc)]);
        }
        let e = s.get("enum").and_then(Value::as_array)?;
        Some(
            e.iter()
                .filter(|v| !v.is_null())
                .map(|v| (v.to_string(), doc.clone()))
                .collect(),
        )
    };
    if let Some(one_of) = schema.get("oneOf").and_then(Value::as_array) {
        let mut all = Vec::new();
        for s in one_of {
            all.extend(plain(s)?);
        }
        return Some(all);
    }
    plain(schema).filter(|_| schema.get("enum").is_some())
}

/// The type of a key, in words (`integer`, `list of string`, `one of "kv", "random"`, …).
fn type_of(schema: &Value) -> String {
    let optional = nullable(schema);
    let s = non_null(schema);
    let base = if let Some(values) = enum_values(s) {
        let names: Vec<String> = values.iter().map(|(v, _)| format!("`{v}`")).collect();
        format!("one of {}", names.join(", "))
    } else {
        let types: Vec<&str> = match s.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts
                .iter()
                .filter_map(Value::as_str)
                .filter(|t| *t != "null")
                .collect(),
            _ => Vec::new(),
        };
        match types.as_slice() {
            ["array"] => match s.get("items") {
                Some(items) if enum_values(items).is_some() => {
                    format!("list, each {}", type_of(items))
                }
                Some(items) if items.get("properties").is_some() => "list of tables".to_string(),
                Some(items) => format!("list of {}", type_of(items)),
                None => "list".to_string(),
            },
            ["object"] => "table".to_string(),
            [t] => (*t).to_string(),
            _ => "value".to_string(),
        }
    };
    if optional {
        format!("{base} (optional)")
    } else {
        base
    }
}

/// The docs of an enum's values, as a Markdown list (`None` when none has one).
fn values_doc(schema: &Value) -> Option<String> {
    let s = non_null(schema);
    let values = enum_values(s).or_else(|| s.get("items").and_then(enum_values))?;
    if values.iter().all(|(_, d)| d.is_none()) {
        return None;
    }
    let lines: Vec<String> = values
        .iter()
        .map(|(v, d)| match d {
            Some(d) => format!("- `{v}`: {}", d.replace('\n', " ")),
            None => format!("- `{v}`"),
        })
        .collect();
    Some(lines.join("\n"))
}

/// A key's unit: its name's suffix, else the schema's `x-unit`, else a unit its doc names.
fn unit_of(field: &str, schema: &Value) -> Option<String> {
    if let Some((_, u)) = SUFFIX_UNITS
        .iter()
        .find(|(suffix, _)| field.ends_with(suffix))
    {
        return Some((*u).to_string());
    }
    if let Some(u) = schema.get("x-unit").and_then(Value::as_str) {
        return Some(u.to_string());
    }
    let doc = schema.get("description").and_then(Value::as_str)?;
    DOC_UNITS
        .iter()
        .find(|(pattern, _)| doc.contains(pattern))
        .map(|(_, u)| (*u).to_string())
}

/// A schema's doc (title and description), with rustdoc's intra-doc links made plain code.
fn doc_of(schema: &Value) -> Option<String> {
    let get = |k: &str| {
        schema
            .get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    let text = match (get("title"), get("description")) {
        (Some(t), Some(d)) => format!("{t}\n\n{d}"),
        (Some(t), None) => t.to_string(),
        (None, Some(d)) => d.to_string(),
        (None, None) => return None,
    };
    Some(plain_links(&text))
}

/// The doc of a key's type (a section's struct doc), when the key's own doc replaced it.
fn type_doc_of(schema: &Value) -> Option<String> {
    schema
        .get("x-type-doc")
        .and_then(Value::as_str)
        .filter(|d| !d.is_empty())
        .map(plain_links)
}

/// `[`X`]` and `[`X`](path)` (rustdoc links) → `` `X` `` (the paths mean nothing outside
/// the crate's docs).
fn plain_links(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("[`") {
        let Some(close) = rest[at..].find("`]") else {
            break;
        };
        let inner = &rest[at + 1..at + close + 1];
        out.push_str(&rest[..at]);
        out.push_str(inner);
        rest = &rest[at + close + 2..];
        if rest.starts_with('(')
            && let Some(end) = rest.find(')')
            && !rest[..end].contains(char::is_whitespace)
        {
            rest = &rest[end + 1..];
        }
    }
    out.push_str(rest);
    out
}

/// A default as it would be written in TOML (`unset` for none), with a readable form of
/// large byte counts and durations.
fn render_default(field: &str, v: &Value) -> String {
    if v.is_null() {
        return "unset".to_string();
    }
    let text = toml_text(v);
    let readable = v.as_u64().and_then(|n| {
        if field.ends_with("_bytes") {
            bytes_text(n)
        } else if field.ends_with("_ms") {
            ms_text(n)
        } else {
            None
        }
    });
    match readable {
        Some(r) => format!("`{text}` ({r})"),
        None => format!("`{text}`"),
    }
}

/// `v` as a TOML value (`["a", "b"]`, `{ min = 1 }`).
fn toml_text(v: &Value) -> String {
    match v {
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(toml_text).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(m) => {
            let items: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{k} = {}", toml_text(v)))
                .collect();
            format!("{{ {} }}", items.join(", "))
        }
        _ => v.to_string(),
    }
}

/// `n` bytes in KiB, MiB or GiB when it is a whole number of them.
fn bytes_text(n: u64) -> Option<String> {
    [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")]
        .iter()
        .find(|(unit, _)| n >= *unit && n.is_multiple_of(*unit))
        .map(|(unit, name)| format!("{} {name}", n / unit))
}

/// `n` ms in h, min or s when it is at least a second and a whole number of them.
fn ms_text(n: u64) -> Option<String> {
    [(3_600_000, "h"), (60_000, "min"), (1_000, "s")]
        .iter()
        .find(|(unit, _)| n >= *unit && n.is_multiple_of(*unit))
        .map(|(unit, name)| format!("{} {name}", n / unit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_reference_is_the_generated_one() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/config-reference.md");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        let generated = markdown() + "\n";
        assert!(
            committed == generated,
            "docs/config-reference.md is not what the configuration types say: regenerate it \
             with `{COMMAND}`"
        );
    }

    #[test]
    fn every_key_of_the_defaults_is_in_the_reference() {
        fn paths(prefix: &str, v: &Value, out: &mut Vec<String>) {
            if let Value::Object(m) = v {
                for (k, v) in m {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    if !prefix.is_empty() {
                        out.push(p.clone());
                    }
                    paths(&p, v, out);
                }
            }
        }
        let text = markdown();
        let mut keys = Vec::new();
        paths(
            "",
            &serde_json::to_value(Config::default()).unwrap(),
            &mut keys,
        );
        assert!(keys.len() > 100, "{}", keys.len());
        for k in keys {
            assert!(text.contains(&format!("### `{k}`")), "{k} is missing");
        }
        for (k, unit) in [
            ("cluster.liveness_timeout_ms", "ms"),
            ("cluster.max_frame_bytes", "bytes"),
            ("worker.sim_transfer_gbps", "GB/s"),
            ("planner.interval_s", "s"),
        ] {
            let at = text.find(&format!("### `{k}`")).unwrap();
            let line = text[at..].lines().nth(2).unwrap();
            assert!(line.contains(&format!("unit {unit}")), "{k}: {line}");
        }
        assert!(
            text.contains("`cluster.liveness_timeout_ms`\n\ninteger · default `3000` (3 s)"),
            "the type, default and unit follow the key"
        );
    }

    #[test]
    fn rustdoc_links_become_code() {
        assert_eq!(
            plain_links("see [`DEFAULT_KV_BLOCKS`] and [`X`](crate::a::X), [not a link]"),
            "see `DEFAULT_KV_BLOCKS` and `X`, [not a link]"
        );
    }
}
