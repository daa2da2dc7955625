-- The shop of tests/domain.rs: orders, and at most one refund per order.
CREATE TABLE orders (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    item TEXT NOT NULL,
    quantity INTEGER NOT NULL,
    status TEXT NOT NULL DEFAULT 'placed'
);

CREATE TABLE refunds (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id BIGINT NOT NULL UNIQUE REFERENCES orders (id),
    reason TEXT NOT NULL
);
