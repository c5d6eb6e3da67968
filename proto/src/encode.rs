//! Encoding a message straight into a [`Write`], through a small fixed buffer, instead
//! of into a `Vec` of its whole size first. A record can be tens of MiB (a captured
//! request and answer); the spool and the segment writer must not hold a second copy
//! of it just to hand it to a file or to zstd.

use std::io::{self, Write};
use std::ops::Range;

use bytes::{Buf, Bytes};
use prost::Message;
use prost::encoding::{WireType, decode_key, decode_varint, encode_key, encode_varint};

use crate::{Record, RecordKind};

/// Calls whose two bodies together are shorter than this are encoded the plain way.
const PIECES_FROM: usize = 64 << 10;
/// `Record.llm_call`, `LlmCall.request_body`, `LlmCall.response_body` (record.proto).
const TAG_LLM_CALL: u32 = 10;
const TAG_REQUEST_BODY: u32 = 16;
const TAG_RESPONSE_BODY: u32 = 17;

/// A record's encoding in pieces: the fields encoded, except the two bodies of a large
/// call, which stay the buffers the call holds (no copy). Laid end to end, the pieces
/// are byte for byte `record.encode_to_vec()` (or `encode_length_delimited_to_vec`).
#[derive(Debug)]
pub struct Pieces {
    parts: Vec<Bytes>,
    len: usize,
}

impl Pieces {
    /// The encoding of `record`, length-delimited when `delimited`. The record is
    /// borrowed mutably only to encode it once with one-byte stand-ins for its bodies;
    /// it is the same when this returns.
    pub fn of(record: &mut Record, delimited: bool) -> Pieces {
        let large = match &record.kind {
            Some(RecordKind::LlmCall(c)) => {
                c.request_body.len() + c.response_body.len() >= PIECES_FROM
            }
            _ => false,
        };
        if !large {
            let whole = if delimited {
                record.encode_length_delimited_to_vec()
            } else {
                record.encode_to_vec()
            };
            return Pieces::from(vec![Bytes::from(whole)]);
        }
        let Some(RecordKind::LlmCall(call)) = &mut record.kind else {
            unreachable!("checked above")
        };
        let stand_in = Bytes::from_static(&[0]);
        let request = std::mem::replace(&mut call.request_body, stand_in.clone());
        let response = std::mem::replace(&mut call.response_body, stand_in);
        let marked = record.encode_to_vec();
        if let Some(RecordKind::LlmCall(call)) = &mut record.kind {
            call.request_body = request.clone();
            call.response_body = response.clone();
        }
        let pieces = splice(&marked, request, response)
            .expect("prost's own encoding has the fields it was given");
        if !delimited {
            return pieces;
        }
        let mut prefix = Vec::with_capacity(10);
        encode_varint(pieces.len as u64, &mut prefix);
        let mut parts = vec![Bytes::from(prefix)];
        parts.extend(pieces.parts);
        Pieces::from(parts)
    }

    /// Bytes in all.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// CRC-32C (Castagnoli) of the whole encoding.
    pub fn crc32c(&self) -> u32 {
        self.parts
            .iter()
            .fold(0, |crc, p| crc32c::crc32c_append(crc, p))
    }

    /// Writes the encoding to `sink`.
    pub fn write_to(&self, sink: &mut impl Write) -> io::Result<()> {
        for p in &self.parts {
            sink.write_all(p)?;
        }
        Ok(())
    }
}

impl From<Vec<Bytes>> for Pieces {
    fn from(parts: Vec<Bytes>) -> Self {
        let len = parts.iter().map(Bytes::len).sum();
        Pieces { parts, len }
    }
}

/// One field of an encoded message: its tag, where the whole field lies, and where its
/// value does.
#[derive(Clone)]
struct Field {
    tag: u32,
    whole: Range<usize>,
    value: Range<usize>,
}

/// The top-level fields of an encoded message, in order.
fn fields(mut buf: &[u8]) -> Option<Vec<Field>> {
    let total = buf.len();
    let mut out = Vec::new();
    while buf.has_remaining() {
        let start = total - buf.len();
        let (tag, wire) = decode_key(&mut buf).ok()?;
        let value_start;
        match wire {
            WireType::Varint => {
                decode_varint(&mut buf).ok()?;
                value_start = total - buf.len();
            }
            WireType::SixtyFourBit | WireType::ThirtyTwoBit => {
                let n = if wire == WireType::SixtyFourBit { 8 } else { 4 };
                value_start = total - buf.len();
                if buf.len() < n {
                    return None;
                }
                buf.advance(n);
            }
            WireType::LengthDelimited => {
                let n = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
                value_start = total - buf.len();
                if buf.len() < n {
                    return None;
                }
                buf.advance(n);
            }
            WireType::StartGroup | WireType::EndGroup => return None,
        }
        let end = total - buf.len();
        out.push(Field {
            tag,
            whole: start..end,
            value: value_start..end,
        });
    }
    Some(out)
}

/// A length-delimited field's key and length, for a value of `len` bytes.
fn field_head(tag: u32, len: usize) -> Vec<u8> {
    let mut head = Vec::with_capacity(12);
    encode_key(tag, WireType::LengthDelimited, &mut head);
    encode_varint(len as u64, &mut head);
    head
}

/// Replaces the one-byte stand-ins of `marked` (a record encoded with bodies `[0]`)
/// by `request` and `response`, fixing the call's length.
fn splice(marked: &[u8], request: Bytes, response: Bytes) -> Option<Pieces> {
    let top = fields(marked)?;
    let Field {
        whole: call_field,
        value: call_value,
        ..
    } = top.iter().find(|f| f.tag == TAG_LLM_CALL)?.clone();
    let call = &marked[call_value];
    let mut bodies: Vec<(Range<usize>, u32, Bytes)> = Vec::new();
    for Field { tag, whole, .. } in fields(call)? {
        match tag {
            TAG_REQUEST_BODY => bodies.push((whole, tag, request.clone())),
            TAG_RESPONSE_BODY => bodies.push((whole, tag, response.clone())),
            _ => {}
        }
    }
    if bodies.len() != 2 {
        return None;
    }
    bodies.sort_by_key(|b| b.0.start);
    // The call's new length: the stand-in fields out, the real ones in (an empty body
    // is not encoded, as prost leaves out default values).
    let mut call_len = call.len();
    for (whole, tag, body) in &bodies {
        call_len -= whole.len();
        if !body.is_empty() {
            call_len += field_head(*tag, body.len()).len() + body.len();
        }
    }
    let mut parts = Vec::new();
    let mut text = marked[..call_field.start].to_vec();
    text.extend_from_slice(&field_head(TAG_LLM_CALL, call_len));
    let mut at = 0;
    for (whole, tag, body) in bodies {
        text.extend_from_slice(&call[at..whole.start]);
        if !body.is_empty() {
            text.extend_from_slice(&field_head(tag, body.len()));
            parts.push(Bytes::from(std::mem::take(&mut text)));
            parts.push(body);
        }
        at = whole.end;
    }
    text.extend_from_slice(&call[at..]);
    text.extend_from_slice(&marked[call_field.end..]);
    parts.push(Bytes::from(text));
    Some(Pieces::from(parts))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Completion, LlmCall};

    fn record(request: usize, response: usize, completion: usize) -> Record {
        Record::new(
            "sidecar-a",
            7,
            1,
            RecordKind::LlmCall(LlmCall {
                span_id: "x".into(),
                episode_id: "e".repeat(request % 7),
                request_body: (0..request)
                    .map(|i| (i * 31) as u8)
                    .collect::<Vec<u8>>()
                    .into(),
                response_body: vec![b'r'; response].into(),
                response_body_size: response as u64 * 3,
                http_status: 200,
                completions: vec![Completion {
                    text: "t".repeat(completion),
                    ..Completion::default()
                }],
                ..LlmCall::default()
            }),
        )
    }

    #[test]
    fn the_pieces_are_prosts_encoding_byte_for_byte() {
        let sizes = [0, 1, 127, 128, 16_383, 16_384, PIECES_FROM, 300_000];
        for &req in &sizes {
            for &resp in &sizes {
                let mut r = record(req, resp, req / 5);
                let before = r.clone();
                for delimited in [false, true] {
                    let want = if delimited {
                        r.encode_length_delimited_to_vec()
                    } else {
                        r.encode_to_vec()
                    };
                    let pieces = Pieces::of(&mut r, delimited);
                    assert_eq!(r, before, "the record is given back as it was");
                    let mut got = Vec::new();
                    pieces.write_to(&mut got).unwrap();
                    assert_eq!(pieces.len(), want.len(), "{req} {resp} {delimited}");
                    assert!(got == want, "{req} {resp} {delimited}");
                    assert_eq!(pieces.crc32c(), crc32c::crc32c(&want));
                    if req + resp >= PIECES_FROM && req.min(resp) > 0 {
                        assert!(pieces.parts.len() >= 5, "bodies are their own pieces");
                    }
                }
            }
        }
    }

    #[test]
    fn large_bodies_are_not_copied() {
        let mut r = record(1 << 20, 1 << 20, 10);
        let Some(RecordKind::LlmCall(call)) = &r.kind else {
            unreachable!()
        };
        let (req, resp) = (call.request_body.as_ptr(), call.response_body.as_ptr());
        let pieces = Pieces::of(&mut r, true);
        let ptrs: Vec<*const u8> = pieces.parts.iter().map(|p| p.as_ptr()).collect();
        assert!(ptrs.contains(&req) && ptrs.contains(&resp));
    }

    #[test]
    fn other_records_are_one_piece() {
        let mut r = Record::new(
            "s",
            1,
            1,
            RecordKind::Reward(crate::Reward {
                reward_id: "r".into(),
                ..Default::default()
            }),
        );
        let pieces = Pieces::of(&mut r, false);
        assert_eq!(pieces.parts.len(), 1);
        assert_eq!(pieces.len(), r.encoded_len());
    }
}
