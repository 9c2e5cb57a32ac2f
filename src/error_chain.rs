//! An error and its causes on one line, for logs and for the one line a failed command prints.

/// `error: cause: cause of the cause`, skipping a cause whose text its parent already ends with
/// (wrappers that repeat their source).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !s.ends_with(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
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

    #[test]
    fn joins_causes_on_one_line() {
        let e = Outer(std::io::Error::other("broken pipe"));
        assert_eq!(error_chain(&e), "valkey write failed: broken pipe");
    }
}
