"""What one marking statement costs Postgres, by how many ids it carries
(scripts/measure-marking.sh).

The stream marks the rows it delivered with one UPDATE (or, with OUTBOX_DELETE_DELIVERED, one
DELETE) per coalesced batch of (id, event_id) pairs: the statements of src/store/statements.rs
`mark_delivered_sql` (what `mark_delivered_returning` sends), copied below with `%s` for `$1`
and `$2`, unprepared as the relay sends them; the test
`mark_cost_py_measures_the_relays_marking_statements` (tests/bench_statements.rs) fails when a
copy differs. This fills a migrated, empty outbox table with the rows it needs, then runs them
over ROWS rows per statement size and kind, on one connection, and prints the backend's CPU per
row and per statement, read from /proc/PID/schedstat of that backend (so the server must run on
this machine).
"""

from __future__ import annotations

import argparse
import sys

import psycopg
from psycopg.types.numeric import Int8

UPDATE = ("UPDATE outbox_events o SET published_at = now() "
          "FROM unnest(%s::bigint[], %s::uuid[]) AS d(id, event_id) "
          "WHERE o.id = d.id AND o.event_id = d.event_id AND o.published_at IS NULL "
          "RETURNING o.id")
DELETE = ("DELETE FROM outbox_events o USING unnest(%s::bigint[], %s::uuid[]) AS d(id, event_id) "
          "WHERE o.id = d.id AND o.event_id = d.event_id RETURNING o.id")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--database-url", required=True)
    ap.add_argument("--rows", type=int, default=60_000, help="rows per statement size and kind")
    ap.add_argument("--sizes", default="20,100,500,2000,10000", help="ids per statement")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    with psycopg.connect(a.database_url, autocommit=True) as c:
        backend = c.execute("SELECT pg_backend_pid()").fetchone()[0]

        def cpu_s() -> float:
            with open(f"/proc/{backend}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9

        need = a.rows * len(sizes) * 2
        c.execute("INSERT INTO outbox_events (event_id, event_name, payload) "
                  "SELECT gen_random_uuid(), 'order.placed', "
                  "jsonb_build_object('order_id', g, 'note', repeat('x', 120)) "
                  "FROM generate_series(1, %s) g", (need,))
        c.execute("VACUUM ANALYZE outbox_events")
        rows = c.execute("SELECT id, event_id FROM outbox_events WHERE published_at IS NULL "
                         "ORDER BY id").fetchall()
        if len(rows) != need:
            raise SystemExit(f"mark_cost: {len(rows)} unpublished rows, {need} expected "
                             "(the table must start empty)")
        print("| statement | ids per statement | backend CPU µs per row "
              "| backend CPU ms per statement |")
        print("|---|---:|---:|---:|")
        pos = 0
        for kind, sql in (("UPDATE (mark)", UPDATE), ("DELETE", DELETE)):
            for size in sizes:
                chunk, pos = rows[pos:pos + a.rows], pos + a.rows
                c0, done, statements = cpu_s(), 0, 0
                for i in range(0, len(chunk), size):
                    part = chunk[i:i + size]
                    # bigint[] and uuid[] as tokio-postgres sends them (a list of Python ints
                    # would go as int4[] and be cast).
                    got = c.execute(sql, ([Int8(r[0]) for r in part], [r[1] for r in part]),
                                    prepare=False).fetchall()
                    done, statements = done + len(got), statements + 1
                spent = cpu_s() - c0
                if done != len(chunk):
                    raise SystemExit(f"mark_cost: {kind} found {done} of {len(chunk)} rows")
                # Fewer rows than a statement takes: it carried them all, and says so.
                print(f"| {kind} | {done // statements:,} | {spent / done * 1e6:.1f} "
                      f"| {spent / statements * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
