//! JSON text exactly as Go's `encoding/json` writes it, for the parts of the Envelope the relay
//! writes itself (the `payload` is the row's JSON, passed through untouched).

use std::collections::BTreeMap;

/// Appends `s` as a JSON string the way Go's `json.Marshal` does: HTML-sensitive characters and
/// U+2028/U+2029 escaped, control characters as `\uXXXX` with lowercase hex.
pub fn write_go_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let short: Option<&[u8]> = match b {
            b'"' => Some(b"\\\""),
            b'\\' => Some(b"\\\\"),
            b'\n' => Some(b"\\n"),
            b'\r' => Some(b"\\r"),
            b'\t' => Some(b"\\t"),
            0x08 => Some(b"\\b"),
            0x0c => Some(b"\\f"),
            _ => None,
        };
        if let Some(esc) = short {
            out.extend_from_slice(&bytes[start..i]);
            out.extend_from_slice(esc);
            i += 1;
            start = i;
        } else if b < 0x20 || b == b'<' || b == b'>' || b == b'&' {
            out.extend_from_slice(&bytes[start..i]);
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
            i += 1;
            start = i;
        } else if b == 0xe2
            && i + 2 < bytes.len()
            && bytes[i + 1] == 0x80
            && (bytes[i + 2] & 0xfe) == 0xa8
        {
            // U+2028 LINE SEPARATOR and U+2029 PARAGRAPH SEPARATOR.
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
