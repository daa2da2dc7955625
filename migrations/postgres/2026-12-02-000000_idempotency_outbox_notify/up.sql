-- Announce new and requeued outbox messages on the channel
-- 'idempotency_outbox', in the transaction that writes them: PostgreSQL
-- delivers the notification when that transaction commits, and never if it
-- rolls back. A notification only wakes listening relays early; they poll
-- as well, so a lost notification delays a message, never loses it.
CREATE FUNCTION idempotency_outbox_announce() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idempotency_outbox', '');
    RETURN NULL;
END
$$;

-- Once per inserting statement, however many rows it writes.
CREATE TRIGGER idempotency_outbox_announce_insert
AFTER INSERT ON idempotency_outbox
FOR EACH STATEMENT EXECUTE FUNCTION idempotency_outbox_announce();

-- A dead message made pending again.
CREATE TRIGGER idempotency_outbox_announce_requeue
AFTER UPDATE OF status ON idempotency_outbox
FOR EACH ROW WHEN (NEW.status = 'pending' AND OLD.status <> 'pending')
EXECUTE FUNCTION idempotency_outbox_announce();
