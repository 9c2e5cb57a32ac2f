//! The fuzz targets' properties (fuzz/targets.rs) on the stable toolchain, in every test run:
//! libFuzzer needs nightly, which this project's CI does not have, so these drive the same two
//! functions with proptest instead. Inputs are both arbitrary bytes and valid messages and rows
//! with a few random mutations (flipped, dropped and inserted bytes, lengths set at random), so
//! the decoder's length and tag checks and the task builder's validation are reached rather
//! than rejected at the first byte. A failure prints the smallest input proptest found.

#[path = "../fuzz/targets.rs"]
mod targets;

use proptest::prelude::*;

/// A column of an Insert's tuple: null, unchanged TOAST, or text.
#[derive(Debug, Clone)]
enum Column {
    Null,
    Unchanged,
    Text(Vec<u8>),
}

fn column() -> impl Strategy<Value = Column> {
    prop_oneof![
        1 => Just(Column::Null),
        1 => Just(Column::Unchanged),
        8 => proptest::collection::vec(any::<u8>(), 0..48).prop_map(Column::Text),
    ]
}

/// A well-formed Insert into relation 7 (the outbox table's Relation in fuzz/targets.rs).
fn insert(columns: &[Column]) -> Vec<u8> {
    let mut m = vec![b'I', 0, 0, 0, 7, b'N'];
    m.extend_from_slice(&(columns.len() as i16).to_be_bytes());
    for c in columns {
        match c {
            Column::Null => m.push(b'n'),
            Column::Unchanged => m.push(b'u'),
            Column::Text(t) => {
                m.push(b't');
                m.extend_from_slice(&(t.len() as i32).to_be_bytes());
                m.extend_from_slice(t);
            }
        }
    }
    m
}

/// One change to a message: (kind, position, byte).
fn mutate(mut m: Vec<u8>, edits: &[(u8, usize, u8)]) -> Vec<u8> {
    for &(kind, at, byte) in edits {
        if m.is_empty() {
            m.push(byte);
            continue;
        }
        let at = at % m.len();
        match kind % 4 {
            0 => m[at] ^= byte | 1,
            1 => m.truncate(at),
            2 => m.insert(at, byte),
            _ => {
                // A length or count field set at random.
                let end = (at + 4).min(m.len());
                for b in &mut m[at..end] {
                    *b = byte;
                }
            }
        }
    }
    m
}

fn edits() -> impl Strategy<Value = Vec<(u8, usize, u8)>> {
    proptest::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 0..4)
}

/// Text that is often what the builder accepts and sometimes not.
fn event_id() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string()),
        1 => any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string().to_uppercase()),
        1 => ".{0,40}",
    ]
}

fn json_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => (".{0,20}", any::<i64>()).prop_map(|(k, v)| serde_json::json!({ k: v }).to_string()),
        1 => Just("{}".to_owned()),
        1 => Just("[1, 2.5e300, null, \"\\u0000\"]".to_owned()),
        1 => ".{0,40}",
    ]
}

fn metadata() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::collection::btree_map(".{0,12}", ".{0,24}", 0..4)
            .prop_map(|m| serde_json::to_string(&m).unwrap()),
        1 => json_text(),
    ]
}

fn created_at() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => (2000u32..2100, 1u32..13, 1u32..29, 0u32..24, 0u32..1_000_000).prop_map(
            |(y, mo, d, h, us)| format!("{y}-{mo:02}-{d:02} {h:02}:15:30.{us:06}+00")
        ),
        1 => ".{0,32}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_decoder_takes_any_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        targets::decode_target(&data);
    }

    #[test]
    fn the_decoder_takes_mutated_inserts(
        rows in proptest::collection::vec(
            (proptest::collection::vec(column(), 0..9), edits()), 1..4),
    ) {
        let mut data = Vec::new();
        for (columns, edits) in rows {
            if !data.is_empty() {
                data.push(0xfe);
            }
            data.extend(mutate(insert(&columns), &edits));
        }
        targets::decode_target(&data);
    }

    #[test]
    fn the_task_builder_takes_any_row(
        id in event_id(),
        name in prop_oneof![3 => "[a-z]{1,8}\\.[a-z_]{1,12}", 1 => ".{0,24}"],
        payload in json_text(),
        meta in metadata(),
        created in created_at(),
        edits in edits(),
    ) {
        let row = [id, name, payload, meta, created].join("\u{1}");
        targets::task_target(row.as_bytes());
        targets::task_target(&mutate(row.into_bytes(), &edits));
    }
}

/// The generators must reach the deep paths, or the properties above prove little: on a fixed
/// seed, valid-looking rows often become tasks and mutated inserts often still decode.
#[test]
fn generated_inputs_reach_the_decoder_and_the_builder() {
    use proptest::test_runner::TestRunner;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let (rows, tasks) = (AtomicUsize::new(0), AtomicUsize::new(0));
    TestRunner::deterministic()
        .run(
            &(event_id(), json_text(), metadata(), created_at()),
            |(id, payload, meta, created)| {
                let row = [id, "order.placed".into(), payload, meta, created].join("\u{1}");
                rows.fetch_add(1, Ordering::Relaxed);
                if targets::task_target(row.as_bytes()) {
                    tasks.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            },
        )
        .unwrap();
    let (rows, tasks) = (rows.into_inner(), tasks.into_inner());
    assert!(
        tasks * 4 >= rows,
        "only {tasks} of {rows} generated rows became tasks"
    );

    let (messages, inserts) = (AtomicUsize::new(0), AtomicUsize::new(0));
    TestRunner::deterministic()
        .run(
            &(proptest::collection::vec(column(), 7..8), edits()),
            |(columns, edits)| {
                messages.fetch_add(1, Ordering::Relaxed);
                let n = targets::decode_target(&mutate(insert(&columns), &edits));
                inserts.fetch_add(n, Ordering::Relaxed);
                Ok(())
            },
        )
        .unwrap();
    let (messages, inserts) = (messages.into_inner(), inserts.into_inner());
    assert!(
        inserts * 5 >= messages,
        "only {inserts} of {messages} mutated inserts decoded"
    );
}
