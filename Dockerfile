# Dockerfile — outbox-relay container image.
#
#   docker build -t outbox-relay .
#   docker run --rm -e OUTBOX_DATABASE_URL=... -e OUTBOX_VALKEY_URL=... outbox-relay        # run
#   docker run --rm -e OUTBOX_DATABASE_URL=... outbox-relay migrate
#
# Settings come from OUTBOX_* environment variables (`outbox-relay run --help`).

# ---- build ------------------------------------------------------------------
FROM rust:1-bookworm AS builder
WORKDIR /src

# Dependencies first, in their own layer: build them against a dummy crate so
# that changing src/ does not rebuild the whole dependency tree. Every target
# Cargo.toml names must exist for cargo to read it: the library, the binary,
# each [[bench]] and each [[example]] get an empty stand-in.
# scripts/check-dockerfile.sh replays these steps in CI (no Docker engine needed).
COPY Cargo.toml Cargo.lock ./
# The vendored pgwire-replication ([patch.crates-io] in Cargo.toml).
COPY vendor ./vendor
RUN mkdir -p src benches examples \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && for bench in $(sed -n '/^\[\[bench\]\]/,/^name/s/^name = "\(.*\)"$/\1/p' Cargo.toml); do \
        echo 'fn main() {}' > "benches/$bench.rs"; \
    done \
    && for example in $(sed -n '/^\[\[example\]\]/,/^name/s/^name = "\(.*\)"$/\1/p' Cargo.toml); do \
        echo 'fn main() {}' > "examples/$example.rs"; \
    done \
    && cargo build --release --locked \
    && rm -rf src \
        target/release/outbox-relay* \
        target/release/liboutbox_relay* \
        target/release/deps/outbox_relay-* \
        target/release/deps/liboutbox_relay-* \
        target/release/.fingerprint/outbox-relay-*

# The real sources (migrations/ is embedded by `migrate`). Dropping the dummy
# crate's fingerprints above (and the touch) makes cargo rebuild it even when
# the copied files are older than the dummy build.
COPY src ./src
COPY migrations ./migrations
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked \
    && install -m 0755 target/release/outbox-relay /usr/local/bin/outbox-relay

# ---- runtime ----------------------------------------------------------------
FROM debian:bookworm-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 outbox \
    && useradd --system --uid 10001 --gid outbox --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin outbox

COPY --from=builder /usr/local/bin/outbox-relay /usr/local/bin/outbox-relay

USER 10001:10001
ENTRYPOINT ["/usr/local/bin/outbox-relay"]
CMD ["run"]
