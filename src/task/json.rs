//! JSON text exactly as Go's `encoding/json` writes it, for the parts of the Envelope the relay
//! writes itself (the `payload` is the row's JSON, passed through untouched).

use std::collections::BTreeMap;

/// Bytes that stop the copy of a plain run: the ones Go escapes, and 0xE2, the lead byte of
/// U+2028/U+2029 (checked in full where it appears). Every other byte is copied as it is.
const STOPS: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = true;
        b += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t[b'<' as usize] = true;
    t[b'>' as usize] = true;
    t[b'&' as usize] = true;
    t[0xe2] = true;
    t
};

/// Appends `s` as a JSON string the way Go's `json.Marshal` does: HTML-sensitive characters and
/// U+2028/U+2029 escaped, control characters as `\uXXXX` with lowercase hex.
///
/// Plain runs are found with one table look-up a byte and copied whole: this is on every task's
/// path (the profile in docs/benchmarks.md had the byte-by-byte version as the relay's hottest
/// function).
pub fn write_go_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if !STOPS[usize::from(b)] {
            i += 1;
            continue;
        }
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0xe2 => {
                // U+2028 LINE SEPARATOR and U+2029 PARAGRAPH SEPARATOR; any other character
                // with this lead byte is copied as it is.
                if i + 2 < bytes.len() && bytes[i + 1] == 0x80 && (bytes[i + 2] & 0xfe) == 0xa8 {
                    out.extend_from_slice(&bytes[start..i]);
                    out.extend_from_slice(if bytes[i + 2] == 0xa8 {
                        b"\\u2028"
                    } else {
                        b"\\u2029"
                    });
                    i += 3;
                    start = i;
                } else {
                    i += 1;
                }
                continue;
            }
            _ => {
                // The other control characters, and < > &.
                out.extend_from_slice(&bytes[start..i]);
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xf)]);
                i += 1;
                start = i;
                continue;
            }
        };
        out.extend_from_slice(&bytes[start..i]);
        out.extend_from_slice(esc);
        i += 1;
        start = i;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// Appends a `map[string]string` as Go marshals it: keys sorted, no spaces.
pub fn write_go_string_map(out: &mut Vec<u8>, map: &BTreeMap<String, String>) {
    out.push(b'{');
    for (i, (k, v)) in map.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_go_string(out, k);
        out.push(b':');
        write_go_string(out, v);
    }
    out.push(b'}');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn go(s: &str) -> String {
        let mut out = Vec::new();
        write_go_string(&mut out, s);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn escapes_like_go() {
        assert_eq!(go("plain"), "\"plain\"");
        assert_eq!(go("a\"b\\c"), r#""a\"b\\c""#);
        assert_eq!(go("\n\r\t\u{8}\u{c}"), r#""\n\r\t\b\f""#);
        assert_eq!(go("\u{1}\u{1f}"), r#""\u0001\u001f""#);
        assert_eq!(go("<a&b>"), r#""\u003ca\u0026b\u003e""#);
        assert_eq!(go("x\u{2028}y\u{2029}z"), r#""x\u2028y\u2029z""#);
        assert_eq!(go("héllo ✓"), "\"héllo ✓\"");
    }

    #[test]
    fn escaped_strings_parse_back() {
        let s = "tricky \" \\ \n <tag> & \u{2028} \u{0} é";
        let back: String = serde_json::from_str(&go(s)).unwrap();
        assert_eq!(back, s);
    }

    /// The byte-by-byte escaping this module had before the table: the fast path must write
    /// exactly what it wrote.
    fn reference(s: &str) -> Vec<u8> {
        let mut out = vec![b'"'];
        let bytes = s.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            match b {
                b'"' => out.extend_from_slice(b"\\\""),
                b'\\' => out.extend_from_slice(b"\\\\"),
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => out.extend_from_slice(b"\\r"),
                b'\t' => out.extend_from_slice(b"\\t"),
                0x08 => out.extend_from_slice(b"\\b"),
                0x0c => out.extend_from_slice(b"\\f"),
                _ if b < 0x20 || b == b'<' || b == b'>' || b == b'&' => {
                    out.extend_from_slice(format!("\\u{b:04x}").as_bytes())
                }
                0xe2 if bytes.get(i + 1) == Some(&0x80)
                    && bytes.get(i + 2).is_some_and(|c| c & 0xfe == 0xa8) =>
                {
                    let last = if bytes[i + 2] == 0xa8 { '8' } else { '9' };
                    out.extend_from_slice(format!("\\u202{last}").as_bytes());
                    i += 2;
                }
                _ => out.push(b),
            }
            i += 1;
        }
        out.push(b'"');
        out
    }

    proptest::proptest! {
        #[test]
        fn the_table_writes_what_the_byte_loop_wrote(s in "(?s:.{0,64})|[\\x00-\\x7f\u{2027}-\u{202a}<>&\"\\\\]{0,64}") {
            let mut out = b"prefix".to_vec();
            write_go_string(&mut out, &s);
            proptest::prop_assert_eq!(&out[6..], &reference(&s)[..]);
            let back: String = serde_json::from_slice(&out[6..]).unwrap();
            proptest::prop_assert_eq!(back, s);
        }
    }

    #[test]
    fn maps_are_sorted_and_compact() {
        let mut m = BTreeMap::new();
        m.insert("tracestate".to_string(), "k=v".to_string());
        m.insert("traceparent".to_string(), "00-1".to_string());
        let mut out = Vec::new();
        write_go_string_map(&mut out, &m);
        assert_eq!(out, br#"{"traceparent":"00-1","tracestate":"k=v"}"#);
    }
}
