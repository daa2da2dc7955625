-- One row per (scope, key). A row is committed only together with the
-- operation it guards, so other transactions only ever see 'completed' rows;
-- 'processing' is visible to the claiming transaction alone.
--
-- Keys and scopes are visible ASCII of at most 255 bytes (the crate refuses
-- others), compared byte for byte: ascii_bin keeps 'Key' and 'key' apart,
-- where MySQL's default collations would make them one key. Responses are
-- JSON text in utf8mb4, up to 4 GB (a statement carrying one must also fit
-- the server's max_allowed_packet).
-- Times are UTC, DATETIME(6) rather than TIMESTAMP, whose range ends in 2038
-- while retention may reach a hundred years.
CREATE TABLE idempotency_keys (
    scope VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    idempotency_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    status VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL CHECK (status IN ('processing', 'completed')),
    response LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    created_at DATETIME(6) NOT NULL,
    completed_at DATETIME(6),
    expires_at DATETIME(6) NOT NULL,
    PRIMARY KEY (scope, idempotency_key),
    INDEX idempotency_keys_expires_at (expires_at)
) ENGINE = InnoDB DEFAULT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
