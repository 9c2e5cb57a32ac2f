//! Byte fixtures for every message the decoder reads, malformed ones included.

use super::*;
use proptest::prelude::*;

fn cache() -> RelationCache {
    RelationCache::new(TableName::parse("outbox_events").unwrap())
}

/// A Relation message as Postgres 15 sends it.
fn relation_msg(id: u32, ns: &str, name: &str, cols: &[&str]) -> Vec<u8> {
    let mut m = vec![b'R'];
    m.extend_from_slice(&id.to_be_bytes());
    for s in [ns, name] {
        m.extend_from_slice(s.as_bytes());
        m.push(0);
    }
    m.push(b'd');
    m.extend_from_slice(&(cols.len() as i16).to_be_bytes());
    for c in cols {
        m.push(0);
        m.extend_from_slice(c.as_bytes());
        m.push(0);
        m.extend_from_slice(&25u32.to_be_bytes());
        m.extend_from_slice(&(-1i32).to_be_bytes());
    }
    m
}

/// An Insert message whose columns are text, or NULL for `None`.
fn insert_msg(id: u32, vals: &[Option<&str>]) -> Vec<u8> {
    let mut m = vec![b'I'];
    m.extend_from_slice(&id.to_be_bytes());
    m.push(b'N');
    m.extend_from_slice(&(vals.len() as i16).to_be_bytes());
    for v in vals {
        match v {
            None => m.push(b'n'),
            Some(s) => {
                m.push(b't');
                m.extend_from_slice(&(s.len() as i32).to_be_bytes());
                m.extend_from_slice(s.as_bytes());
            }
        }
    }
    m
}

const KIT_COLUMNS: [&str; 7] = [
    "id",
    "event_id",
    "event_name",
    "payload",
    "metadata",
    "created_at",
    "published_at",
];

fn kit_row() -> [Option<&'static str>; 7] {
    [
        Some("1"),
        Some("0b9e5a0c-6c1f-4d6e-9a57-2f1f3c0e8d11"),
        Some("order.placed"),
        Some("{\"total\": 42.50}"),
        Some("{}"),
        Some("2026-11-29 10:15:30.123456+00"),
        None,
    ]
}

#[test]
fn a_hand_written_relation_fixture_decodes() {
    // 'R', oid 16390, "public", "outbox_events", replica identity 'd', 1 column:
    // flags 1, "id", type 20 (int8), typmod -1.
    let bytes = hex::decode(concat!(
        "52",
        "00004006",
        "7075626c696300",
        "6f7574626f785f6576656e747300",
        "64",
        "0001",
        "01",
        "696400",
        "00000014",
        "ffffffff"
    ))
    .unwrap();
    let mut c = cache();
    assert!(matches!(
        decode(&bytes, &mut c),
        Ok(Decoded::Relation { relation_id: 16390 })
    ));
    let rel = c.get(16390).unwrap();
    assert_eq!(rel.columns, vec!["id"]);
    assert_eq!(
        rel.outbox_map().unwrap().missing(),
        &[
            OutboxColumn::EventId,
            OutboxColumn::EventName,
            OutboxColumn::Payload,
            OutboxColumn::CreatedAt
        ]
    );
}

#[test]
fn insert_maps_columns_by_name() {
    let mut c = cache();
    decode(
        &relation_msg(7, "public", "outbox_events", &KIT_COLUMNS),
        &mut c,
    )
    .unwrap();
    let msg = insert_msg(7, &kit_row());
    let Decoded::Insert(row) = decode(&msg, &mut c).unwrap() else {
        panic!("expected an insert")
    };
    assert_eq!(row.text(OutboxColumn::Id).unwrap(), Some("1"));
    assert_eq!(
        row.text(OutboxColumn::EventName).unwrap(),
        Some("order.placed")
    );
    assert_eq!(
        row.text(OutboxColumn::Payload).unwrap(),
        Some("{\"total\": 42.50}")
    );
    assert_eq!(row.text(OutboxColumn::Metadata).unwrap(), Some("{}"));
    assert_eq!(
        row.text(OutboxColumn::CreatedAt).unwrap(),
        Some("2026-11-29 10:15:30.123456+00")
    );
}

#[test]
fn any_column_order_and_extra_columns_work() {
    let mut c = cache();
    let cols = [
        "tenant",
        "payload",
        "created_at",
        "event_name",
        "event_id",
        "note",
    ];
    decode(&relation_msg(9, "app", "outbox_events", &cols), &mut c).unwrap();
    let msg = insert_msg(
        9,
        &[
            Some("acme"),
            Some("{}"),
            Some("2026-01-01 00:00:00+00"),
            Some("x.y"),
            Some("id-1"),
            None,
        ],
    );
    let Decoded::Insert(row) = decode(&msg, &mut c).unwrap() else {
        panic!("expected an insert")
    };
    assert_eq!(row.text(OutboxColumn::EventName).unwrap(), Some("x.y"));
    assert_eq!(row.text(OutboxColumn::EventId).unwrap(), Some("id-1"));
    assert_eq!(row.text(OutboxColumn::Metadata).unwrap(), None);
    assert_eq!(row.text(OutboxColumn::Id).unwrap(), None);
}

#[test]
fn a_new_relation_message_replaces_the_old_definition() {
    let mut c = cache();
    decode(
        &relation_msg(7, "public", "outbox_events", &KIT_COLUMNS),
        &mut c,
    )
    .unwrap();
    let mut cols = KIT_COLUMNS.to_vec();
    cols.insert(0, "added_later");
    decode(&relation_msg(7, "public", "outbox_events", &cols), &mut c).unwrap();
    let mut vals = kit_row().to_vec();
    vals.insert(0, Some("new"));
    let msg = insert_msg(7, &vals);
    let Decoded::Insert(row) = decode(&msg, &mut c).unwrap() else {
        panic!("expected an insert")
    };
    assert_eq!(
        row.text(OutboxColumn::EventName).unwrap(),
        Some("order.placed")
    );
}

#[test]
fn inserts_into_other_tables_are_not_outbox_rows() {
    let mut c = cache();
    decode(&relation_msg(8, "public", "orders", &["id"]), &mut c).unwrap();
    let msg = insert_msg(8, &[Some("5")]);
    assert!(matches!(
        decode(&msg, &mut c),
        Ok(Decoded::OtherInsert { relation_id: 8 })
    ));
}

#[test]
fn schema_qualified_table_only_matches_its_schema() {
    let mut c = RelationCache::new(TableName::parse("billing.outbox_events").unwrap());
    decode(
        &relation_msg(1, "public", "outbox_events", &KIT_COLUMNS),
        &mut c,
    )
    .unwrap();
    decode(
        &relation_msg(2, "billing", "outbox_events", &KIT_COLUMNS),
        &mut c,
    )
    .unwrap();
    assert!(c.get(1).unwrap().outbox_map().is_none());
    assert!(c.get(2).unwrap().outbox_map().is_some());
}

#[test]
fn update_delete_truncate_and_friends_are_ignored() {
    let mut c = cache();
    for tag in [b'U', b'D', b'T', b'Y', b'O', b'B', b'C', b'M'] {
        assert!(matches!(decode(&[tag, 1, 2, 3], &mut c), Ok(Decoded::Ignored(t)) if t == tag));
    }
}

#[test]
fn unknown_tag_and_empty_message_are_errors() {
    let mut c = cache();
    assert_eq!(decode(&[], &mut c).unwrap_err(), DecodeError::Empty);
    assert_eq!(
        decode(b"Z", &mut c).unwrap_err(),
        DecodeError::UnknownTag(b'Z')
    );
}

#[test]
fn insert_before_its_relation_is_an_error() {
    let mut c = cache();
    let msg = insert_msg(42, &kit_row());
    assert_eq!(
        decode(&msg, &mut c).unwrap_err(),
        DecodeError::UnknownRelation(42)
    );
}

#[test]
fn every_truncation_of_valid_messages_is_an_error() {
    let rel = relation_msg(7, "public", "outbox_events", &KIT_COLUMNS);
    let ins = insert_msg(7, &kit_row());
    for cut in 1..rel.len() {
        let mut c = cache();
        assert!(
            decode(&rel[..cut], &mut c).is_err(),
            "relation cut at {cut}"
        );
    }
    let mut c = cache();
    decode(&rel, &mut c).unwrap();
    for cut in 1..ins.len() {
        assert!(decode(&ins[..cut], &mut c).is_err(), "insert cut at {cut}");
    }
}

#[test]
fn negative_lengths_are_errors_not_panics() {
    let mut c = cache();
    decode(
        &relation_msg(7, "public", "outbox_events", &KIT_COLUMNS),
        &mut c,
    )
    .unwrap();
    // One text column whose length is -2.
    let mut msg = vec![b'I', 0, 0, 0, 7, b'N', 0, 1, b't'];
    msg.extend_from_slice(&(-2i32).to_be_bytes());
    assert!(matches!(
        decode(&msg, &mut c),
        Err(DecodeError::NegativeLength { len: -2, .. })
    ));
    // A negative column count.
    let msg = [b'I', 0, 0, 0, 7, b'N', 0xff, 0xff];
    assert!(matches!(
        decode(&msg, &mut c),
        Err(DecodeError::NegativeLength { len: -1, .. })
    ));
    // A length far beyond the message.
    let mut msg = vec![b'I', 0, 0, 0, 7, b'N', 0, 1, b't'];
    msg.extend_from_slice(&i32::MAX.to_be_bytes());
    assert!(matches!(
        decode(&msg, &mut c),
        Err(DecodeError::Truncated { .. })
    ));
}

#[test]
fn malformed_fields_are_errors() {
    let mut c = cache();
    decode(
        &relation_msg(7, "public", "outbox_events", &KIT_COLUMNS),
        &mut c,
    )
    .unwrap();
    assert_eq!(
        decode(&[b'I', 0, 0, 0, 7, b'K', 0, 0], &mut c).unwrap_err(),
        DecodeError::BadTupleMarker(b'K')
    );
    assert!(matches!(
        decode(&[b'I', 0, 0, 0, 7, b'N', 0, 1, b'x'], &mut c),
        Err(DecodeError::UnknownColumnKind { kind: b'x', .. })
    ));
    let mut trailing = insert_msg(7, &kit_row());
    trailing.push(0);
    assert_eq!(
        decode(&trailing, &mut c).unwrap_err(),
        DecodeError::TrailingBytes { trailing: 1 }
    );
    let mut bad_utf8 = vec![b'R', 0, 0, 0, 1, 0xff, 0xfe, 0];
    bad_utf8.extend_from_slice(b"t\0d\0\0");
    assert!(matches!(
        decode(&bad_utf8, &mut c),
        Err(DecodeError::InvalidUtf8 { .. })
    ));
    assert!(matches!(
        decode(&[b'R', 0, 0, 0, 1, b'p', b'u'], &mut c),
        Err(DecodeError::UnterminatedString { .. })
    ));
}

#[test]
fn unusable_values_are_row_errors() {
    let mut c = cache();
    decode(
        &relation_msg(7, "public", "outbox_events", &KIT_COLUMNS),
        &mut c,
    )
    .unwrap();
    let mut msg = vec![b'I', 0, 0, 0, 7, b'N', 0, 3, b'n', b'u', b't'];
    msg.extend_from_slice(&2i32.to_be_bytes());
    msg.extend_from_slice(&[0xc3, 0x28]);
    let Decoded::Insert(row) = decode(&msg, &mut c).unwrap() else {
        panic!("expected an insert")
    };
    assert_eq!(row.text(OutboxColumn::Id).unwrap(), None);
    assert_eq!(
        row.text(OutboxColumn::EventId).unwrap_err(),
        RowError::Unchanged(OutboxColumn::EventId)
    );
    assert_eq!(
        row.text(OutboxColumn::EventName).unwrap_err(),
        RowError::NotUtf8(OutboxColumn::EventName)
    );
}

#[test]
fn table_names_are_validated() {
    assert!(TableName::parse("outbox_events").is_some());
    assert!(TableName::parse("app.outbox_events").is_some());
    for bad in ["", "Outbox", "a;drop", "a.b.c", "1abc", "a-b", "x."] {
        assert!(TableName::parse(bad).is_none(), "{bad}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut c = cache();
        decode(&relation_msg(7, "public", "outbox_events", &KIT_COLUMNS), &mut c).unwrap();
        let _ = decode(&data, &mut c);
    }

    #[test]
    fn mutated_valid_messages_never_panic(
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        which in 0usize..2,
    ) {
        let mut c = cache();
        let rel = relation_msg(7, "public", "outbox_events", &KIT_COLUMNS);
        let mut msg = if which == 0 { rel.clone() } else { insert_msg(7, &kit_row()) };
        decode(&rel, &mut c).unwrap();
        for (i, b) in flips {
            let n = msg.len();
            msg[i % n] = b;
        }
        if let Ok(Decoded::Insert(row)) = decode(&msg, &mut c) {
            for col in OutboxColumn::ALL {
                let _ = row.text(col);
            }
        }
    }
}
