-- An outbox table the relay publishes from (Debezium's column names), with the index the
-- polling relay needs. The partition expression must be written exactly as below, with
-- N = spec.ordering.partitions (here 4): the planner matches the relay's filter against
-- the index expression textually. See src/postgres/polling.rs.

CREATE TABLE IF NOT EXISTS public.outbox (
    id            bigserial PRIMARY KEY,
    aggregatetype text        NOT NULL,
    aggregateid   text        NOT NULL,
    type          text        NOT NULL,
    payload       jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz
);

-- Oldest unpublished rows of a partition, by index (polling, ordering.partitions = 4).
CREATE INDEX IF NOT EXISTS outbox_unpublished_p4 ON public.outbox
    (((hashtextextended(coalesce("aggregateid"::text, ''), 0) & 9223372036854775807) % 4), "id")
    WHERE "published_at" IS NULL;

-- Retention: published rows by age (afterPublish: mark).
CREATE INDEX IF NOT EXISTS outbox_published_at ON public.outbox (published_at)
    WHERE published_at IS NOT NULL;

-- failure.onExhausted: deadLetter. The relay creates this table itself when it may;
-- create it up front when its database user has no CREATE privilege.
CREATE TABLE IF NOT EXISTS public.outbox_dead_letter (
    LIKE public.outbox,
    dead_letter_reason text        NOT NULL,
    dead_lettered_at   timestamptz NOT NULL DEFAULT now()
);
