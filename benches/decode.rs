//! The pgoutput decoder on a realistic outbox row: the table as `outbox-relay migrate` leaves it
//! (the Go kit's columns plus the delivery-state columns), a ~220-byte jsonb payload and a
//! traceparent in the metadata.
//!
//! `cargo bench --bench decode` (add `-- --quick` for a short run).

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use outbox_relay::pgoutput::{decode, Decoded, OutboxColumn, RelationCache, TableName};

const RELATION_ID: u32 = 16_390;

/// Column name, type oid and whether it is part of the replica identity (the primary key).
const COLUMNS: [(&str, u32, bool); 11] = [
    ("id", 20, true),
    ("event_id", 2950, false),
    ("event_name", 25, false),
    ("payload", 3802, false),
    ("metadata", 3802, false),
    ("created_at", 1184, false),
    ("published_at", 1184, false),
    ("attempts", 23, false),
    ("last_error", 25, false),
    ("next_attempt_at", 1184, false),
    ("dead_at", 1184, false),
];

const PAYLOAD: &str = r#"{"items": [{"qty": 2, "sku": "SKU-42", "price_cents": 1999}, {"qty": 1, "sku": "SKU-42", "price_cents": 4550}], "currency": "EUR", "order_id": "ord_0000000042", "customer_id": "cus_3f1a9c07be52", "total_cents": 33598}"#;
const METADATA: &str = r#"{"producer": "checkout", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#;

/// A Relation message as Postgres sends it for the migrated outbox table.
fn relation_msg() -> Vec<u8> {
    let mut m = vec![b'R'];
    m.extend_from_slice(&RELATION_ID.to_be_bytes());
    for s in ["public", "outbox_events"] {
        m.extend_from_slice(s.as_bytes());
        m.push(0);
    }
    m.push(b'd');
    m.extend_from_slice(&(COLUMNS.len() as i16).to_be_bytes());
    for (name, oid, key) in COLUMNS {
        m.push(u8::from(key));
        m.extend_from_slice(name.as_bytes());
        m.push(0);
        m.extend_from_slice(&oid.to_be_bytes());
        m.extend_from_slice(&(-1i32).to_be_bytes());
    }
    m
}

/// An Insert message of one outbox row, text columns and NULLs.
fn insert_msg() -> Vec<u8> {
    let values: [Option<&str>; 11] = [
        Some("1234567"),
        Some("0b9e5a0c-6c1f-4d6e-9a57-2f1f3c0e8d11"),
        Some("order.placed"),
        Some(PAYLOAD),
        Some(METADATA),
        Some("2026-11-29 10:15:30.123456+00"),
        None,
        Some("0"),
        None,
        None,
        None,
    ];
    let mut m = vec![b'I'];
    m.extend_from_slice(&RELATION_ID.to_be_bytes());
    m.push(b'N');
    m.extend_from_slice(&(values.len() as i16).to_be_bytes());
    for v in values {
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

fn cache() -> RelationCache {
    RelationCache::new(TableName::parse("outbox_events").expect("a valid table name"))
}

fn bench_decode(c: &mut Criterion) {
    let relation = relation_msg();
    let insert = insert_msg();
    let mut group = c.benchmark_group("decode");
    group.throughput(Throughput::Elements(1));

    group.bench_function("relation", |b| {
        let mut cache = cache();
        b.iter(|| {
            let decoded = decode(black_box(&relation), &mut cache).expect("decodes");
            black_box(matches!(decoded, Decoded::Relation { .. }));
        })
    });

    let mut cache = cache();
    decode(&relation, &mut cache).expect("decodes");
    group.bench_function("insert", |b| {
        b.iter(
            || match decode(black_box(&insert), &mut cache).expect("decodes") {
                Decoded::Insert(row) => {
                    black_box(&row);
                }
                other => panic!("not an insert: {other:?}"),
            },
        )
    });

    // What the stream does per row before building the task: decode, then read every column it
    // uses as UTF-8 text.
    group.bench_function("insert_and_columns", |b| {
        b.iter(
            || match decode(black_box(&insert), &mut cache).expect("decodes") {
                Decoded::Insert(row) => {
                    for col in OutboxColumn::ALL {
                        black_box(row.text(col).expect("text column"));
                    }
                }
                other => panic!("not an insert: {other:?}"),
            },
        )
    });
    group.finish();
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
