DROP TABLE refunds;
DROP TABLE orders;
