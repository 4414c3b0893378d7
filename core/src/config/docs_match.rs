//! `docs/config.md` and `slurm-conf/sluice.toml` against the keys the code reads.
//!
//! The keys come from [`RawConfig`] itself, not from a list kept by hand: [`Probe`] is a serde
//! deserializer that hands every field of every struct a placeholder value and notes the field's
//! dotted path, so a key added to a raw struct (or renamed with `#[serde(rename)]`) is a key these
//! tests ask the reference and the example for. Three sets must be equal:
//!
//! - the code's keys;
//! - config.md's: a table row whose first cell is `` `key` ``, under a heading naming its TOML
//!   table (`` ## `[peer]` ``), each key once;
//! - sluice.toml's: every key set, or shown commented out (`# key = value`), so the example an
//!   admin copies names every key there is.
//!
//! A map-valued key (`[peer.nodes]`: node = address) is one key, `peer.nodes`; its entries are
//! the admin's names, not keys.

use super::RawConfig;
use serde::Deserialize;
use serde::de::value::{Error, StrDeserializer};
use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};
use std::cell::RefCell;
use std::collections::BTreeSet;

const CONFIG_MD: &str = include_str!("../../../docs/config.md");
const EXAMPLE: &str = include_str!("../../../slurm-conf/sluice.toml");

/// What the probe found: dotted paths of tables (struct-valued fields, `[[arrays]]` of them
/// included), of those tables that are arrays, of keys (every other field), and of the keys whose
/// value is a map.
#[derive(Debug, Default)]
struct Found {
    tables: BTreeSet<String>,
    arrays: BTreeSet<String>,
    keys: BTreeSet<String>,
    maps: BTreeSet<String>,
}

/// Deserializes any of the config's raw types from nothing, noting each field's path in `found`.
struct Probe<'a> {
    path: String,
    /// An element of a sequence: a struct here is a `[[table]]`.
    element: bool,
    found: &'a RefCell<Found>,
}

impl<'a> Probe<'a> {
    fn key(&self) {
        self.found.borrow_mut().keys.insert(self.path.clone());
    }

    fn field(&self, name: &str) -> Probe<'a> {
        let path = match self.path.as_str() {
            "" => name.to_string(),
            p => format!("{p}.{name}"),
        };
        Probe {
            path,
            element: false,
            found: self.found,
        }
    }
}

/// A placeholder value every visitor of that primitive type accepts.
macro_rules! leaf {
    ($($method:ident => $visit:ident($value:expr)),* $(,)?) => {
        $(fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
            self.key();
            v.$visit($value)
        })*
    };
}

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Err(de::Error::custom(format!(
            "{}: a type the probe does not know how to fill; teach docs_match.rs",
            self.path
        )))
    }

    leaf! {
        deserialize_bool => visit_bool(false),
        deserialize_u8 => visit_u64(0),
        deserialize_u16 => visit_u64(0),
        deserialize_u32 => visit_u64(0),
        deserialize_u64 => visit_u64(0),
        deserialize_i8 => visit_i64(0),
        deserialize_i16 => visit_i64(0),
        deserialize_i32 => visit_i64(0),
        deserialize_i64 => visit_i64(0),
        deserialize_f32 => visit_f64(0.0),
        deserialize_f64 => visit_f64(0.0),
        deserialize_char => visit_char('x'),
        deserialize_str => visit_str(""),
        deserialize_string => visit_str(""),
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_some(self)
    }

    /// One element: a `Vec<String>` is then a key, a `Vec<Struct>` a `[[table]]`.
    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_seq(One(Some(Probe {
            element: true,
            ..self
        })))
    }

    /// A map of the admin's names (`[peer.nodes]`): one key, with no entries.
    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        self.key();
        self.found.borrow_mut().maps.insert(self.path.clone());
        v.visit_map(Fields {
            probe: self,
            fields: &[],
            next: 0,
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Error> {
        if !self.path.is_empty() {
            let mut found = self.found.borrow_mut();
            found.tables.insert(self.path.clone());
            if self.element {
                found.arrays.insert(self.path.clone());
            }
        }
        v.visit_map(Fields {
            probe: self,
            fields,
            next: 0,
        })
    }

    serde::forward_to_deserialize_any! {
        i128 u128 bytes byte_buf unit unit_struct newtype_struct tuple tuple_struct enum
        identifier ignored_any
    }
}

/// Every field of a struct, each with a probe one level down.
struct Fields<'a> {
    probe: Probe<'a>,
    fields: &'static [&'static str],
    next: usize,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let Some(name) = self.fields.get(self.next) else {
            return Ok(None);
        };
        let name: StrDeserializer<'_, Error> = name.into_deserializer();
        seed.deserialize(name).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let name = self.fields[self.next];
        self.next += 1;
        seed.deserialize(self.probe.field(name))
    }
}

struct One<'a>(Option<Probe<'a>>);

impl<'de> SeqAccess<'de> for One<'_> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        self.0.take().map(|p| seed.deserialize(p)).transpose()
    }
}

/// The tables and keys `sluice.toml` may hold, as the code reads them.
fn code() -> Found {
    let found = RefCell::new(Found::default());
    RawConfig::deserialize(Probe {
        path: String::new(),
        element: false,
        found: &found,
    })
    .expect("the probe fills every field of RawConfig");
    found.into_inner()
}

/// `[a.b]` or `[[a.b]]` as a whole line: `a.b`.
fn table_header(line: &str) -> Option<&str> {
    let name = line
        .strip_prefix("[[")
        .and_then(|l| l.strip_suffix("]]"))
        .or_else(|| line.strip_prefix('[').and_then(|l| l.strip_suffix(']')))?;
    let ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.');
    ok.then_some(name)
}

/// A bare TOML key: lower case, digits, `_`.
fn is_key(word: &str) -> bool {
    !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// config.md's tables (from its headings) and keys, in the order written (so a key documented
/// twice shows twice).
fn documented(md: &str) -> (BTreeSet<String>, Vec<String>) {
    let (mut tables, mut keys) = (BTreeSet::new(), Vec::new());
    let mut table: Option<String> = None;
    for line in md.lines() {
        if line.starts_with('#') {
            // A heading names the table its rows belong to in its first code span, if any.
            table = line
                .split('`')
                .nth(1)
                .and_then(table_header)
                .map(str::to_string);
            tables.extend(table.clone());
        } else if let (Some(t), Some(row)) = (&table, line.strip_prefix('|')) {
            let first = row.split('|').next().unwrap_or_default().trim();
            if let Some(key) = first.strip_prefix('`').and_then(|k| k.strip_suffix('`'))
                && is_key(key)
            {
                keys.push(format!("{t}.{key}"));
            }
        }
    }
    (tables, keys)
}

/// The keys the example sets or shows commented out. Under a map's table (`[peer.nodes]`) the
/// lines are entries of that one key.
fn in_example(toml: &str, maps: &BTreeSet<String>) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut table = String::new();
    for line in toml.lines() {
        let line = line.trim();
        let line = line.strip_prefix("# ").unwrap_or(line);
        if let Some(t) = table_header(line) {
            table = t.to_string();
        } else if let Some((key, _)) = line.split_once(" = ")
            && is_key(key)
        {
            keys.insert(if maps.contains(&table) {
                table.clone()
            } else {
                format!("{table}.{key}")
            });
        }
    }
    keys
}

fn listed(keys: impl IntoIterator<Item = impl AsRef<str>>) -> String {
    keys.into_iter()
        .map(|k| k.as_ref().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The smallest config with `line` in `table`, as the parser sees it: `Err` with what it says.
fn parse_with(found: &Found, table: &str, line: &str) -> Result<(), String> {
    let key = line.split(" = ").next().unwrap_or_default();
    let mut text = String::new();
    for (t, body) in [
        ("agent", ["socket='/s'", "state_dir='/st'"].as_slice()),
        ("hot_tier", &["root='/h'"]),
    ] {
        text += &format!("[{t}]\n");
        for l in body.iter().filter(|l| !l.starts_with(&format!("{key}="))) {
            text += &format!("{l}\n");
        }
        if t == table {
            text += &format!("{line}\n");
        }
    }
    if table != "agent" && table != "hot_tier" {
        let header = match found.arrays.contains(table) {
            true => format!("[[{table}]]"),
            false => format!("[{table}]"),
        };
        text += &format!("{header}\n{line}\n");
    }
    super::tests::parse(&text, "n1").map(drop)
}

#[test]
fn the_probe_finds_the_keys_the_parser_accepts() {
    let c = code();
    // A few of each shape, so a probe that found nothing cannot pass the tests below.
    for key in [
        "agent.socket",
        "stage.allow.prefix",
        "ckpt.allow.users",
        "store.data_class",
        "peer.nodes",
        "shared_tier.stripe.count",
        "fast_tier.mount",
    ] {
        assert!(c.keys.contains(key), "{key} not in {:?}", c.keys);
    }
    let arrays = ["ckpt.allow", "shared_tier.stripe", "stage.allow", "store"];
    assert_eq!(c.arrays, arrays.map(String::from).into());
    assert_eq!(
        c.maps,
        ["metrics.nodes", "peer.nodes"].map(String::from).into()
    );
    // Every key it found is one the parser takes, and in every table a key it did not find is
    // refused: the parser's `deny_unknown_fields` and the probe agree.
    for key in &c.keys {
        let (table, name) = key.rsplit_once('.').unwrap();
        let e = parse_with(&c, table, &format!("{name} = 0"))
            .err()
            .unwrap_or_default();
        assert!(!e.contains("unknown field"), "{key}: {e}");
    }
    for table in &c.tables {
        let e = parse_with(&c, table, "no_such_key = 0").unwrap_err();
        assert!(e.contains("unknown field `no_such_key`"), "{table}: {e}");
    }
}

#[test]
fn config_md_documents_every_key_of_the_code_once_and_no_other() {
    let c = code();
    let (tables, keys) = documented(CONFIG_MD);
    let mut seen = BTreeSet::new();
    let twice: Vec<&String> = keys.iter().filter(|k| !seen.insert(k.as_str())).collect();
    assert!(
        twice.is_empty(),
        "docs/config.md documents these keys more than once: {}",
        listed(twice)
    );
    let missing: Vec<&String> = c
        .keys
        .iter()
        .filter(|k| !seen.contains(k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/config.md does not document these keys of core/src/config.rs: {}",
        listed(missing)
    );
    let unknown: Vec<&&str> = seen.iter().filter(|k| !c.keys.contains(**k)).collect();
    assert!(
        unknown.is_empty(),
        "docs/config.md documents keys the agent does not read: {}",
        listed(unknown.iter().map(|k| **k))
    );
    assert_eq!(
        tables, c.tables,
        "docs/config.md's section headings (`[table]` in a heading) against the code's tables"
    );
}

#[test]
fn the_example_sluice_toml_shows_every_key_config_md_documents() {
    let c = code();
    let (_, documented) = documented(CONFIG_MD);
    let documented: BTreeSet<String> = documented.into_iter().collect();
    let example = in_example(EXAMPLE, &c.maps);
    let undocumented: Vec<&String> = example.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "slurm-conf/sluice.toml has keys docs/config.md does not document: {}",
        listed(undocumented)
    );
    let not_shown: Vec<&String> = documented.difference(&example).collect();
    assert!(
        not_shown.is_empty(),
        "slurm-conf/sluice.toml shows neither a line nor a commented line for these keys of docs/config.md: {}",
        listed(not_shown)
    );
}
