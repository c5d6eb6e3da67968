//! A JSON tree that borrows its strings from the input, for reading responses.
//!
//! The rebuild of a response parses every event of a stream (21 events for a short
//! answer, thousands for a long one). `serde_json::Value` with `preserve_order` puts every
//! object in an `IndexMap` (a SipHash per key) and copies every key and string; that was
//! the largest user-space cost of the sidecar per streamed call. [`Json`] keeps objects
//! as small vectors and strings as slices of the input (copied only when they contain
//! escapes). Its accessors have the names and meaning of `serde_json::Value`'s: `get`
//! returns the last of duplicate keys, `as_u64` only non-negative integers, and so on.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// A JSON number, kept as parsed (like `serde_json::Number`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    /// A non-negative integer.
    PosInt(u64),
    /// A negative integer.
    NegInt(i64),
    /// Anything with a fraction or exponent, or out of integer range.
    Float(f64),
}

/// A JSON value whose strings borrow from the parsed text.
#[derive(Debug, Clone, PartialEq)]
pub enum Json<'a> {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number.
    Number(Number),
    /// A string.
    String(Cow<'a, str>),
    /// An array.
    Array(Vec<Json<'a>>),
    /// An object, members in document order (a repeated key keeps its first position and
    /// its last value, as `serde_json` does).
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

impl<'a> Json<'a> {
    /// The same value with every string owned, to keep after its text is gone.
    pub fn into_owned(self) -> Json<'static> {
        let own = |s: Cow<'a, str>| Cow::Owned(s.into_owned());
        match self {
            Json::Null => Json::Null,
            Json::Bool(b) => Json::Bool(b),
            Json::Number(n) => Json::Number(n),
            Json::String(s) => Json::String(own(s)),
            Json::Array(items) => Json::Array(items.into_iter().map(Json::into_owned).collect()),
            Json::Object(members) => Json::Object(
                members
                    .into_iter()
                    .map(|(k, v)| (own(k), v.into_owned()))
                    .collect(),
            ),
        }
    }

    /// Parses `text`.
    pub fn parse(text: &'a [u8]) -> Result<Json<'a>, serde_json::Error> {
        serde_json::from_slice(text)
    }

    /// The member `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Json<'a>> {
        match self {
            Json::Object(members) => members.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    /// A non-negative integer, if this is one.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Json::Number(Number::PosInt(n)) => Some(*n),
            _ => None,
        }
    }

    /// Any number, as a float.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Json::Number(Number::PosInt(n)) => Some(*n as f64),
            Json::Number(Number::NegInt(n)) => Some(*n as f64),
            Json::Number(Number::Float(f)) => Some(*f),
            _ => None,
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&Vec<Json<'a>>> {
        match self {
            Json::Array(items) => Some(items),
            _ => None,
        }
    }

    /// Whether this is an array.
    pub fn is_array(&self) -> bool {
        matches!(self, Json::Array(_))
    }

    /// Whether this is an object.
    pub fn is_object(&self) -> bool {
        matches!(self, Json::Object(_))
    }

    /// Whether this is `null`.
    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }
}

/// Compact JSON text, as `serde_json::Value`'s `Display` writes it.
impl fmt::Display for Json<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = serde_json::to_string(self).map_err(|_| fmt::Error)?;
        f.write_str(&text)
    }
}

impl Serialize for Json<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => serializer.serialize_unit(),
            Json::Bool(b) => serializer.serialize_bool(*b),
            Json::Number(Number::PosInt(n)) => serializer.serialize_u64(*n),
            Json::Number(Number::NegInt(n)) => serializer.serialize_i64(*n),
            Json::Number(Number::Float(f)) => serializer.serialize_f64(*f),
            Json::String(s) => serializer.serialize_str(s),
            Json::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Json::Object(members) => {
                let mut map = serializer.serialize_map(Some(members.len()))?;
                for (k, v) in members {
                    map.serialize_entry(k.as_ref(), v)?;
                }
                map.end()
            }
        }
    }
}

/// A string that borrows from the input when it has no escapes.
struct Str<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StrVisitor;
        impl<'de> Visitor<'de> for StrVisitor {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(StrVisitor)
    }
}

/// Objects up to this many members merge repeated keys (a linear search per member);
/// larger ones keep repeats as separate members (`get` still returns the last).
const DEDUP_LIMIT: usize = 64;

impl<'de: 'a, 'a> Deserialize<'de> for Json<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct JsonVisitor;
        impl<'de> Visitor<'de> for JsonVisitor {
            type Value = Json<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Json::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Json::Null)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                Json::deserialize(d)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(Json::Bool(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Json::Number(Number::PosInt(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Json::Number(match u64::try_from(v) {
                    Ok(n) => Number::PosInt(n),
                    Err(_) => Number::NegInt(v),
                }))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Ok(Json::Number(Number::Float(v)))
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Json::String(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Json::String(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Json::String(Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Json::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members: Vec<(Cow<'de, str>, Json<'de>)> = Vec::new();
                while let Some(Str(key)) = map.next_key()? {
                    let value: Json<'de> = map.next_value()?;
                    let seen = if members.len() <= DEDUP_LIMIT {
                        members.iter_mut().find(|(k, _)| *k == key)
                    } else {
                        None
                    };
                    match seen {
                        Some((_, slot)) => *slot = value,
                        None => members.push((key, value)),
                    }
                }
                Ok(Json::Object(members))
            }
        }
        deserializer.deserialize_any(JsonVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything `Json` answers, compared with `serde_json::Value` on the same text.
    fn same_as_serde(text: &str) {
        let ours = Json::parse(text.as_bytes()).unwrap();
        let theirs: serde_json::Value = serde_json::from_str(text).unwrap();
        assert_eq!(ours.to_string(), theirs.to_string(), "{text}");
        fn walk(a: &Json<'_>, b: &serde_json::Value) {
            assert_eq!(a.as_str(), b.as_str());
            assert_eq!(a.as_u64(), b.as_u64());
            assert_eq!(a.as_f64(), b.as_f64());
            assert_eq!(a.is_array(), b.is_array());
            assert_eq!(a.is_object(), b.is_object());
            assert_eq!(a.is_null(), b.is_null());
            if let (Some(x), Some(y)) = (a.as_array(), b.as_array()) {
                assert_eq!(x.len(), y.len());
                x.iter().zip(y).for_each(|(x, y)| walk(x, y));
            }
            if let serde_json::Value::Object(map) = b {
                for (k, v) in map {
                    walk(a.get(k).unwrap(), v);
                }
            }
        }
        walk(&ours, &theirs);
    }

    /// Found by the json_tree fuzz target: without serde_json's `float_roundtrip`, a
    /// long mantissa parsed to a float one ulp away from the correctly rounded one, so a
    /// log-prob written back out read as another number.
    #[test]
    fn floats_are_parsed_correctly_rounded_and_written_back_the_same() {
        for text in [
            "1e70",
            "1e+70",
            "-0.1",
            "-2.3841855067985307e-7",
            "0.30000000000000004",
        ] {
            let ours = Json::parse(text.as_bytes()).unwrap();
            assert_eq!(ours.as_f64(), Some(text.parse::<f64>().unwrap()), "{text}");
            let written = ours.to_string();
            assert_eq!(Json::parse(written.as_bytes()).unwrap(), ours, "{text}");
        }
        let long = format!("1{}e{}2", "0".repeat(68), "0".repeat(50));
        let ours = Json::parse(long.as_bytes()).unwrap();
        assert_eq!(ours.as_f64(), Some(long.parse::<f64>().unwrap()));
        let written = ours.to_string();
        assert_eq!(Json::parse(written.as_bytes()).unwrap(), ours);
    }

    #[test]
    fn answers_as_serde_json_does() {
        for text in [
            r#"{"a":1,"b":-2,"c":2.5,"d":1e3,"e":"x\"y\u00e9","f":[null,true,false],"g":{}}"#,
            r#"{"k":1,"k":2,"z":0}"#,
            r#"[18446744073709551615,-9223372036854775808,0.1]"#,
            r#""just a string""#,
            r#"{"choices":[{"index":0,"delta":{"content":"hi"},"logprobs":{"content":[{"logprob":-0.5}]}}]}"#,
        ] {
            same_as_serde(text);
        }
    }

    #[test]
    fn strings_without_escapes_are_borrowed() {
        let text = br#"{"plain":"abc","escaped":"a\nb"}"#;
        let json = Json::parse(text).unwrap();
        let Json::Object(members) = &json else {
            panic!("an object")
        };
        assert!(matches!(members[0].0, Cow::Borrowed("plain")));
        assert!(matches!(
            json.get("plain"),
            Some(Json::String(Cow::Borrowed("abc")))
        ));
        assert!(matches!(json.get("escaped"), Some(Json::String(Cow::Owned(s))) if s == "a\nb"));
    }

    #[test]
    fn bad_json_is_an_error() {
        assert!(Json::parse(b"{\"a\":").is_err());
        assert!(Json::parse(b"{} trailing").is_err());
    }
}
