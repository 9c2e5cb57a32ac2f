//! An error and its causes on one line, for logs and for the one line a failed command prints.

/// `error: cause: cause of the cause`, each text once: a cause whose text the line already ends
/// with is skipped (wrappers that print their source), and a cause that repeats its parent's
/// text before its own adds only its own (a wrapper with the same message as what it wraps).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut parent = s.clone();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !text.is_empty() && !s.ends_with(&text) {
            match text.strip_prefix(parent.as_str()) {
                Some(own) if !parent.is_empty() && own.starts_with(": ") => s.push_str(own),
                _ => {
                    s.push_str(": ");
                    s.push_str(&text);
                }
            }
        }
        parent = text;
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("valkey write failed")]
    struct Outer(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("valkey write failed")]
    struct Wrapper(#[source] Printing);

    /// A cause that prints its own source (as some library errors do).
    #[derive(Debug, thiserror::Error)]
    #[error("valkey write failed: {0}")]
    struct Printing(#[source] std::io::Error);

    #[test]
    fn joins_causes_on_one_line() {
        let e = Outer(std::io::Error::other("broken pipe"));
        assert_eq!(error_chain(&e), "valkey write failed: broken pipe");
    }

    #[test]
    fn no_text_repeats() {
        let e = Printing(std::io::Error::other("broken pipe"));
        assert_eq!(error_chain(&e), "valkey write failed: broken pipe");
        let e = Wrapper(Printing(std::io::Error::other("broken pipe")));
        assert_eq!(error_chain(&e), "valkey write failed: broken pipe");
    }
}
