-- Schema version 1 of the PostgreSQL store (proxy/store/postgres.py applies it, once, in
-- one transaction under an advisory lock). Every operation of the store is one function
-- here, so it costs one round trip. Times are Unix seconds (float8); each function takes
-- ``p_now``, NULL for the server's own clock (tests pass a clock they move by hand).
-- Functions that decide on a key first take a transaction-level advisory lock on it, so
-- concurrent calls on one key are serialized and each one sees the others' outcome.

CREATE TABLE records (
    slot text NOT NULL, name text NOT NULL, scope text NOT NULL, state text NOT NULL,
    fingerprint text NOT NULL, owner text NOT NULL, lease_until float8 NOT NULL DEFAULT 0,
    expires_at float8 NOT NULL, created_at float8 NOT NULL, updated_at float8 NOT NULL,
    payload bytea NOT NULL DEFAULT '',
    PRIMARY KEY (slot, name)
);
CREATE INDEX records_expiry ON records (expires_at);
CREATE INDEX records_scope ON records (scope, created_at);
CREATE TABLE last_claims (slot text PRIMARY KEY, name text NOT NULL, expires_at float8 NOT NULL);
CREATE INDEX last_claims_expiry ON last_claims (expires_at);
CREATE TABLE kv (key text PRIMARY KEY, value bytea NOT NULL, expires_at float8 NOT NULL);
CREATE INDEX kv_expiry ON kv (expires_at);

CREATE TABLE limit_rates (
    grp text NOT NULL, key text NOT NULL, tat float8 NOT NULL, PRIMARY KEY (grp, key)
);
CREATE TABLE limit_slots (
    grp text NOT NULL, key text NOT NULL, owner text NOT NULL, until float8 NOT NULL,
    PRIMARY KEY (grp, key, owner)
);
CREATE TABLE limit_pauses (grp text PRIMARY KEY, until float8 NOT NULL);

CREATE TABLE resource_locks (
    key text PRIMARY KEY, owner text NOT NULL, until float8 NOT NULL, token bigint NOT NULL
);
CREATE INDEX resource_locks_until ON resource_locks (until);
CREATE TABLE resource_counters (scope text PRIMARY KEY, n bigint NOT NULL);
CREATE TABLE resource_versions (
    key text PRIMARY KEY, n bigint NOT NULL, written boolean NOT NULL, pending text NOT NULL,
    until float8 NOT NULL
);
CREATE INDEX resource_versions_until ON resource_versions (until);

CREATE TABLE jobs (
    id text PRIMARY KEY, route text NOT NULL, principal text NOT NULL, slot text NOT NULL,
    name text NOT NULL, label text NOT NULL, request bytea NOT NULL, keep float8 NOT NULL,
    state text NOT NULL, attempts integer NOT NULL, sent boolean NOT NULL, error bytea NOT NULL,
    created_at float8 NOT NULL, updated_at float8 NOT NULL, due float8 NOT NULL,
    seq integer NOT NULL, holder text NOT NULL DEFAULT '', held_until float8 NOT NULL DEFAULT 0,
    expires_at float8 NOT NULL
);
CREATE INDEX jobs_expiry ON jobs (expires_at);
CREATE INDEX jobs_queue ON jobs (route, holder, due) WHERE state IN ('queued', 'running');
CREATE TABLE job_events (
    id text NOT NULL, seq integer NOT NULL, state text NOT NULL, attempts integer NOT NULL,
    sent boolean NOT NULL, error bytea NOT NULL, updated_at float8 NOT NULL, due float8 NOT NULL,
    PRIMARY KEY (id, seq)
);

-- A record as the store answers it: ``ttl`` is the seconds left on the lease while
-- IN_PROGRESS, on the outcome otherwise.
CREATE TYPE record_row AS (
    slot text, name text, state text, fingerprint text, owner text, ttl float8,
    payload bytea, created_at float8, updated_at float8
);

CREATE FUNCTION clock(p_now float8) RETURNS float8 LANGUAGE sql STABLE AS $$
    SELECT coalesce(p_now, extract(epoch FROM statement_timestamp())::float8)
$$;

CREATE FUNCTION lock_key(p_kind text, p_a text, p_b text) RETURNS void LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(hashtextextended(p_kind || chr(31) || p_a || chr(31) || p_b, 0))
$$;

CREATE FUNCTION shown(r records, p_now float8) RETURNS record_row LANGUAGE sql STABLE AS $$
    SELECT r.slot, r.name, r.state, r.fingerprint, r.owner,
        greatest(CASE WHEN r.state = 'in_progress' THEN r.lease_until ELSE r.expires_at END
            - p_now, 0),
        r.payload, r.created_at, r.updated_at
$$;

-- claim: ``claimed`` and the previous name of the slot, else the existing record.
CREATE FUNCTION claim(
    p_slot text, p_name text, p_scope text, p_fingerprint text, p_owner text,
    p_lock_ttl float8, p_result_ttl float8, p_reexecute boolean, p_now float8
) RETURNS TABLE (
    claimed boolean, previous text, slot text, name text, state text, fingerprint text,
    owner text, ttl float8, payload bytea, created_at float8, updated_at float8
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    now float8 := clock(p_now);
    r records;
    last_name text;
BEGIN
    PERFORM lock_key('record', p_slot, p_name);
    SELECT * INTO r FROM records WHERE slot = p_slot AND name = p_name AND expires_at > now;
    IF FOUND AND (r.owner <> p_owner OR r.state <> 'in_progress') THEN
        IF r.owner = p_owner OR r.state <> 'in_progress' OR r.lease_until > now THEN
            RETURN QUERY SELECT false, NULL::text, s.* FROM shown(r, now) s;  -- own, or held
            RETURN;
        END IF;
        IF NOT p_reexecute THEN  -- another owner's lapsed lease: FAILED, outcome unknown
            UPDATE records SET state = 'failed', updated_at = now
                WHERE slot = p_slot AND name = p_name RETURNING * INTO r;
            RETURN QUERY SELECT false, NULL::text, s.* FROM shown(r, now) s;
            RETURN;
        END IF;
    END IF;
    INSERT INTO records AS t (slot, name, scope, state, fingerprint, owner, lease_until,
            expires_at, created_at, updated_at, payload)
        VALUES (p_slot, p_name, p_scope, 'in_progress', p_fingerprint, p_owner,
            now + p_lock_ttl, now + p_result_ttl, now, now, '')
        ON CONFLICT (slot, name) DO UPDATE SET scope = excluded.scope, state = excluded.state,
            fingerprint = excluded.fingerprint, owner = excluded.owner,
            lease_until = excluded.lease_until, expires_at = excluded.expires_at,
            created_at = excluded.created_at, updated_at = excluded.updated_at, payload = '';
    SELECT l.name INTO last_name FROM last_claims l WHERE l.slot = p_slot AND l.expires_at > now;
    INSERT INTO last_claims (slot, name, expires_at) VALUES (p_slot, p_name, now + p_result_ttl)
        ON CONFLICT (slot) DO UPDATE SET name = excluded.name, expires_at = excluded.expires_at;
    RETURN QUERY SELECT true, CASE WHEN last_name <> p_name THEN last_name END,
        NULL, NULL, NULL, NULL, NULL, NULL::float8, NULL::bytea, NULL::float8, NULL::float8;
END
$$;

CREATE FUNCTION renew(
    p_slot text, p_name text, p_owner text, p_lock_ttl float8, p_result_ttl float8,
    p_now float8
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
BEGIN
    UPDATE records SET lease_until = now + p_lock_ttl, updated_at = now,
            expires_at = greatest(expires_at, now + p_result_ttl)
        WHERE slot = p_slot AND name = p_name AND owner = p_owner AND state = 'in_progress'
            AND expires_at > now;
    RETURN FOUND;
END
$$;

CREATE FUNCTION complete(
    p_slot text, p_name text, p_scope text, p_owner text, p_fingerprint text, p_state text,
    p_payload bytea, p_result_ttl float8, p_replace boolean, p_successor text, p_now float8
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    r records;
BEGIN
    PERFORM lock_key('record', p_slot, p_name);
    SELECT * INTO r FROM records WHERE slot = p_slot AND name = p_name AND expires_at > now;
    IF FOUND AND r.owner <> p_owner THEN
        RETURN false;
    END IF;
    IF FOUND AND NOT p_replace AND r.state <> 'in_progress'
            AND NOT (r.state = 'failed' AND length(r.payload) = 0) THEN
        RETURN false;  -- an attempt's outcome is there already
    END IF;
    INSERT INTO records AS t (slot, name, scope, state, fingerprint, owner, lease_until,
            expires_at, created_at, updated_at, payload)
        VALUES (p_slot, p_name, p_scope, p_state, p_fingerprint, p_successor, 0,
            now + p_result_ttl, coalesce(r.created_at, now), now, p_payload)
        ON CONFLICT (slot, name) DO UPDATE SET scope = excluded.scope, state = excluded.state,
            fingerprint = excluded.fingerprint, owner = excluded.owner, lease_until = 0,
            expires_at = excluded.expires_at, created_at = excluded.created_at,
            updated_at = excluded.updated_at, payload = excluded.payload;
    RETURN true;
END
$$;

CREATE FUNCTION release(p_slot text, p_name text, p_owner text, p_now float8)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
BEGIN
    DELETE FROM records WHERE slot = p_slot AND name = p_name AND owner = p_owner
        AND expires_at > now
        AND (state = 'in_progress' OR (state = 'failed' AND length(payload) = 0));
    RETURN FOUND;
END
$$;

CREATE FUNCTION get(p_slot text, p_name text, p_now float8) RETURNS SETOF record_row
LANGUAGE sql STABLE AS $$
    SELECT s.* FROM records r, LATERAL shown(r, clock(p_now)) s
        WHERE r.slot = p_slot AND r.name = p_name AND r.expires_at > clock(p_now)
$$;

CREATE FUNCTION scope_records(p_scope text, p_now float8) RETURNS SETOF record_row
LANGUAGE sql STABLE AS $$
    SELECT s.* FROM records r, LATERAL shown(r, clock(p_now)) s
        WHERE r.scope = p_scope AND r.expires_at > clock(p_now)
        ORDER BY r.created_at, r.slot, r.name
$$;

-- scan: up to ``p_count`` rows after (p_slot, p_name), live or not (bounded work); the
-- caller keeps the live ones and the last row's key as the cursor.
CREATE FUNCTION scan(p_slot text, p_name text, p_count integer, p_now float8)
RETURNS TABLE (
    live boolean, slot text, name text, state text, fingerprint text, owner text, ttl float8,
    payload bytea, created_at float8, updated_at float8
) LANGUAGE sql STABLE AS $$
    SELECT r.expires_at > clock(p_now), s.* FROM records r, LATERAL shown(r, clock(p_now)) s
        WHERE (r.slot, r.name) > (p_slot, p_name) ORDER BY r.slot, r.name LIMIT p_count
$$;

CREATE FUNCTION settle(
    p_slot text, p_name text, p_state text, p_payload bytea, p_result_ttl float8,
    p_owner text, p_now float8
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
BEGIN
    IF p_state IS NULL THEN
        DELETE FROM records WHERE slot = p_slot AND name = p_name AND state = 'failed'
            AND expires_at > now AND (p_owner IS NULL OR owner = p_owner);
    ELSE
        UPDATE records SET state = p_state, payload = p_payload,
                expires_at = now + p_result_ttl, updated_at = now
            WHERE slot = p_slot AND name = p_name AND state = 'failed' AND expires_at > now
                AND (p_owner IS NULL OR owner = p_owner);
    END IF;
    RETURN FOUND;
END
$$;

CREATE FUNCTION delete_record(p_slot text, p_name text, p_now float8)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM records WHERE slot = p_slot AND name = p_name AND expires_at > clock(p_now);
    RETURN FOUND;
END
$$;

CREATE FUNCTION put_value(p_key text, p_value bytea, p_ttl float8, p_now float8)
RETURNS void LANGUAGE sql AS $$
    INSERT INTO kv (key, value, expires_at) VALUES (p_key, p_value, clock(p_now) + p_ttl)
        ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
$$;

CREATE FUNCTION get_value(p_key text, p_now float8) RETURNS bytea LANGUAGE sql STABLE AS $$
    SELECT value FROM kv WHERE key = p_key AND expires_at > clock(p_now)
$$;

CREATE FUNCTION acquire_value(p_key text, p_owner bytea, p_ttl float8, p_now float8)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
BEGIN
    INSERT INTO kv AS t (key, value, expires_at) VALUES (p_key, p_owner, now + p_ttl)
        ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
            WHERE t.value = excluded.value OR t.expires_at <= now;
    RETURN FOUND;
END
$$;

CREATE FUNCTION unlock_value(p_key text, p_owner bytea, p_now float8) RETURNS void
LANGUAGE sql AS $$
    DELETE FROM kv WHERE key = p_key AND value = p_owner
$$;

-- sweep: expired rows, at most ``p_batch`` of each table a call; the records deleted.
CREATE FUNCTION sweep(p_batch integer, p_now float8) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    swept integer;
BEGIN
    DELETE FROM records WHERE ctid IN (SELECT ctid FROM records WHERE expires_at <= now
        LIMIT p_batch FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS swept = ROW_COUNT;
    DELETE FROM last_claims WHERE ctid IN (SELECT ctid FROM last_claims
        WHERE expires_at <= now LIMIT p_batch FOR UPDATE SKIP LOCKED);
    DELETE FROM kv WHERE ctid IN (SELECT ctid FROM kv WHERE expires_at <= now
        LIMIT p_batch FOR UPDATE SKIP LOCKED);
    DELETE FROM resource_locks WHERE ctid IN (SELECT ctid FROM resource_locks
        WHERE until <= now LIMIT p_batch FOR UPDATE SKIP LOCKED);
    DELETE FROM resource_versions WHERE ctid IN (SELECT ctid FROM resource_versions
        WHERE until <= now LIMIT p_batch FOR UPDATE SKIP LOCKED);
    DELETE FROM limit_slots WHERE ctid IN (SELECT ctid FROM limit_slots
        WHERE until <= now LIMIT p_batch FOR UPDATE SKIP LOCKED);
    DELETE FROM limit_pauses WHERE ctid IN (SELECT ctid FROM limit_pauses
        WHERE until <= now LIMIT p_batch FOR UPDATE SKIP LOCKED);
    -- a rate whose tat has passed is a full bucket, as if it had no row
    DELETE FROM limit_rates WHERE ctid IN (SELECT ctid FROM limit_rates
        WHERE tat <= now LIMIT p_batch FOR UPDATE SKIP LOCKED);
    WITH gone AS (
        DELETE FROM jobs WHERE ctid IN (SELECT ctid FROM jobs WHERE expires_at <= now
            LIMIT p_batch FOR UPDATE SKIP LOCKED) RETURNING id
    ) DELETE FROM job_events e USING gone WHERE e.id = gone.id;
    RETURN swept;
END
$$;

-- take: GCRA rates, slots and the pause of one group, all or nothing (buckets.py).
CREATE FUNCTION take(
    p_group text, p_rate_keys text[], p_intervals float8[], p_tolerances float8[],
    p_costs float8[], p_slot_keys text[], p_capacities integer[], p_owner text,
    p_slot_ttl float8, p_paused text, p_now float8
) RETURNS TABLE (
    allowed boolean, paused float8, retry_after float8, remaining integer[], reset float8[],
    limited boolean[], free integer[]
) LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    until_ float8;
    wait float8 := 0;
    tats float8[] := '{}';
    tat float8;
    base float8;
    nxt float8;
    excess float8;
    held integer;
    mine boolean;
    is_full boolean := false;
BEGIN
    remaining := '{}'; reset := '{}'; limited := '{}'; free := '{}';
    PERFORM lock_key('group', p_group, '');
    SELECT p.until INTO until_ FROM limit_pauses p WHERE p.grp = p_paused;
    IF FOUND AND until_ > now THEN
        RETURN QUERY SELECT false, until_ - now, 0::float8, remaining, reset, limited, free;
        RETURN;
    END IF;
    FOR i IN 1 .. coalesce(array_length(p_rate_keys, 1), 0) LOOP
        SELECT r.tat INTO tat FROM limit_rates r WHERE r.grp = p_group AND r.key = p_rate_keys[i];
        IF NOT FOUND THEN tat := now; END IF;
        base := greatest(tat, now);
        nxt := base + p_intervals[i] * p_costs[i];
        excess := nxt - p_tolerances[i] - now;
        IF excess > 1e-6 THEN
            wait := greatest(wait, excess);
            tats := tats || tat;
            remaining := remaining || 0; reset := reset || (base - now); limited := limited || true;
        ELSE
            tats := tats || nxt;
            remaining := remaining || greatest(floor((p_tolerances[i] - (nxt - now))
                / p_intervals[i] + 1e-6), 0)::integer;
            reset := reset || (nxt - now); limited := limited || false;
        END IF;
    END LOOP;
    FOR i IN 1 .. coalesce(array_length(p_slot_keys, 1), 0) LOOP
        DELETE FROM limit_slots s WHERE s.grp = p_group AND s.key = p_slot_keys[i]
            AND s.until <= now;
        SELECT count(*), coalesce(bool_or(s.owner = p_owner), false) INTO held, mine
            FROM limit_slots s WHERE s.grp = p_group AND s.key = p_slot_keys[i];
        free := free || (p_capacities[i] - held - (CASE WHEN mine THEN 0 ELSE 1 END));
        is_full := is_full OR free[i] < 0;
    END LOOP;
    IF wait > 0 OR is_full THEN
        RETURN QUERY SELECT false, 0::float8, wait, remaining, reset, limited, free;
        RETURN;
    END IF;
    INSERT INTO limit_rates AS r (grp, key, tat)
        SELECT p_group, k, t FROM unnest(p_rate_keys, tats) AS u(k, t)
        ON CONFLICT (grp, key) DO UPDATE SET tat = excluded.tat;
    INSERT INTO limit_slots AS s (grp, key, owner, until)
        SELECT p_group, k, p_owner, now + p_slot_ttl FROM unnest(p_slot_keys) AS u(k)
        ON CONFLICT (grp, key, owner) DO UPDATE SET until = excluded.until;
    RETURN QUERY SELECT true, 0::float8, 0::float8, remaining, reset, limited, free;
END
$$;

CREATE FUNCTION finish(
    p_group text, p_rate_keys text[], p_intervals float8[], p_units float8[],
    p_slot_keys text[], p_owner text, p_now float8
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    tat float8;
BEGIN
    PERFORM lock_key('group', p_group, '');
    FOR i IN 1 .. coalesce(array_length(p_rate_keys, 1), 0) LOOP
        SELECT r.tat INTO tat FROM limit_rates r WHERE r.grp = p_group AND r.key = p_rate_keys[i];
        IF NOT FOUND THEN tat := now; END IF;
        INSERT INTO limit_rates (grp, key, tat) VALUES (p_group, p_rate_keys[i],
                greatest(greatest(tat, now) + p_intervals[i] * p_units[i], now))
            ON CONFLICT (grp, key) DO UPDATE SET tat = excluded.tat;
    END LOOP;
    DELETE FROM limit_slots s WHERE s.grp = p_group AND s.key = ANY (p_slot_keys)
        AND s.owner = p_owner;
END
$$;

CREATE FUNCTION renew_slots(
    p_group text, p_slot_keys text[], p_owner text, p_ttl float8, p_now float8
) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    kept integer;
BEGIN
    UPDATE limit_slots s SET until = now + p_ttl WHERE s.grp = p_group
        AND s.key = ANY (p_slot_keys) AND s.owner = p_owner AND s.until > now;
    GET DIAGNOSTICS kept = ROW_COUNT;
    RETURN kept = (SELECT count(DISTINCT k) FROM unnest(p_slot_keys) AS u(k));
END
$$;

CREATE FUNCTION pause(p_paused text, p_seconds float8, p_now float8)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
BEGIN
    INSERT INTO limit_pauses AS p (grp, until) VALUES (p_paused, now + p_seconds)
        ON CONFLICT (grp) DO UPDATE SET until = CASE WHEN p.until <= now THEN excluded.until
            ELSE greatest(p.until, excluded.until) END;
END
$$;

-- Locks and versions (locks.py): one counter per scope, never deleted, started at
-- p_start (locks.counter_start: the clock in microseconds) when absent.
CREATE FUNCTION draw(p_scope text, p_start bigint) RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO resource_counters AS c (scope, n) VALUES (p_scope, p_start + 1)
        ON CONFLICT (scope) DO UPDATE SET n = c.n + 1 RETURNING n
$$;

CREATE FUNCTION acquire_lock(
    p_scope text, p_key text, p_owner text, p_ttl float8, p_start bigint, p_now float8
)
RETURNS TABLE (v_token bigint, v_expires_in float8) LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    name text := p_scope || chr(10) || p_key;
    l resource_locks;
    drawn bigint;
BEGIN
    PERFORM lock_key('lock', p_scope, p_key);
    SELECT * INTO l FROM resource_locks WHERE key = name AND until > now;
    IF FOUND AND l.owner <> p_owner THEN
        RETURN QUERY SELECT NULL::bigint, l.until - now;
        RETURN;
    END IF;
    INSERT INTO resource_locks AS t (key, owner, until, token)
        VALUES (name, p_owner, now + p_ttl, coalesce(l.token, draw(p_scope, p_start)))
        ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, until = excluded.until,
            token = excluded.token
        RETURNING t.token INTO drawn;
    RETURN QUERY SELECT drawn, 0::float8;
END
$$;

CREATE FUNCTION renew_lock(p_name text, p_owner text, p_ttl float8, p_now float8)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
BEGIN
    UPDATE resource_locks SET until = now + p_ttl
        WHERE key = p_name AND owner = p_owner AND until > now;
    RETURN FOUND;
END
$$;

CREATE FUNCTION release_lock(p_name text, p_owner text, p_now float8)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM resource_locks WHERE key = p_name AND owner = p_owner AND until > clock(p_now);
    RETURN FOUND;
END
$$;

-- version / begin / settle in one: ``p_op`` is 'read', 'begin' or 'settle'.
CREATE FUNCTION version_op(
    p_op text, p_scope text, p_key text, p_owner text, p_wrote boolean, p_ttl float8,
    p_start bigint, p_now float8
) RETURNS TABLE (v_number bigint, v_written boolean) LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    name text := p_scope || chr(10) || p_key;
    v resource_versions;
BEGIN
    PERFORM lock_key('version', p_scope, p_key);
    SELECT * INTO v FROM resource_versions WHERE key = name AND until > now;
    IF p_op = 'settle' THEN
        IF NOT FOUND OR v.pending <> p_owner THEN
            RETURN;  -- settled already
        END IF;
        IF p_wrote THEN
            v.n := draw(p_scope, p_start); v.written := true;
        END IF;
        v.pending := '';
    ELSE
        IF NOT FOUND THEN
            v.n := draw(p_scope, p_start); v.written := false; v.pending := '';
        END IF;
        IF p_op = 'begin' THEN
            IF v.pending NOT IN ('', p_owner) THEN  -- a write that never settled may have run
                v.n := draw(p_scope, p_start); v.written := true;
            END IF;
            v.pending := p_owner;
        END IF;
    END IF;
    INSERT INTO resource_versions AS t (key, n, written, pending, until)
        VALUES (name, v.n, v.written, v.pending, now + p_ttl)
        ON CONFLICT (key) DO UPDATE SET n = excluded.n, written = excluded.written,
            pending = excluded.pending, until = excluded.until;
    RETURN QUERY SELECT v.n, v.written;
END
$$;

-- The job queue (queue.py). Every change is told on the channel ``tool_proxy_jobs``.
CREATE FUNCTION job_event(j jobs) RETURNS jobs LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO job_events (id, seq, state, attempts, sent, error, updated_at, due)
        VALUES (j.id, j.seq, j.state, j.attempts, j.sent, j.error, j.updated_at, j.due)
        ON CONFLICT (id, seq) DO UPDATE SET state = excluded.state,
            attempts = excluded.attempts, sent = excluded.sent, error = excluded.error,
            updated_at = excluded.updated_at, due = excluded.due;
    PERFORM pg_notify('tool_proxy_jobs', j.id);
    RETURN j;
END
$$;

CREATE FUNCTION submit_job(
    p_id text, p_route text, p_principal text, p_slot text, p_name text, p_label text,
    p_request bytea, p_keep float8, p_now float8
) RETURNS SETOF jobs LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    j jobs;
BEGIN
    PERFORM lock_key('job', p_id, '');
    IF EXISTS (SELECT 1 FROM jobs WHERE id = p_id AND expires_at > now) THEN
        RETURN;  -- the id is in use
    END IF;
    DELETE FROM jobs WHERE id = p_id;  -- expired, not yet swept
    DELETE FROM job_events WHERE id = p_id;
    INSERT INTO jobs (id, route, principal, slot, name, label, request, keep, state, attempts,
            sent, error, created_at, updated_at, due, seq, expires_at)
        VALUES (p_id, p_route, p_principal, p_slot, p_name, p_label, p_request, p_keep,
            'queued', 0, false, '', now, now, now, 1, now + p_keep)
        RETURNING * INTO j;
    RETURN NEXT job_event(j);
END
$$;

CREATE FUNCTION get_job(p_id text, p_now float8) RETURNS SETOF jobs LANGUAGE sql STABLE AS $$
    SELECT * FROM jobs WHERE id = p_id AND expires_at > clock(p_now)
$$;

-- job_events: the job (request empty) as of each event after ``p_after``, oldest first;
-- for an unknown job, one row with ``known`` false.
CREATE FUNCTION job_events(p_id text, p_after integer, p_now float8)
RETURNS TABLE (
    known boolean, id text, route text, principal text, slot text, name text, label text,
    request bytea, keep float8, state text, attempts integer, sent boolean, error bytea,
    created_at float8, updated_at float8, due float8, seq integer
) LANGUAGE sql STABLE AS $$
    SELECT true, j.id, j.route, j.principal, j.slot, j.name, j.label, ''::bytea, j.keep,
            e.state, e.attempts, e.sent, e.error, j.created_at, e.updated_at, e.due, e.seq
        FROM jobs j JOIN job_events e ON e.id = j.id AND e.seq > p_after
        WHERE j.id = p_id AND j.expires_at > clock(p_now)
    UNION ALL
    SELECT false, p_id, '', '', '', '', '', ''::bytea, 0::float8, '', 0, false, ''::bytea,
            0::float8, 0::float8, 0::float8, 0
        WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.id = p_id
            AND jobs.expires_at > clock(p_now))
    ORDER BY seq
$$;

CREATE FUNCTION take_job(p_route text, p_worker text, p_visibility float8, p_now float8)
RETURNS SETOF jobs LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    picked text;
BEGIN
    SELECT id INTO picked FROM jobs WHERE route = p_route AND state = 'queued' AND holder = ''
        AND due <= now AND expires_at > now ORDER BY due, id LIMIT 1 FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT id INTO picked FROM jobs WHERE route = p_route
            AND state IN ('queued', 'running') AND holder <> '' AND held_until <= now
            AND expires_at > now ORDER BY held_until LIMIT 1 FOR UPDATE SKIP LOCKED;
    END IF;
    IF picked IS NOT NULL THEN
        RETURN QUERY UPDATE jobs SET holder = p_worker, held_until = now + p_visibility
            WHERE id = picked RETURNING *;
    END IF;
END
$$;

CREATE FUNCTION hold_job(p_id text, p_worker text, p_visibility float8, p_now float8)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
BEGIN
    UPDATE jobs SET held_until = now + p_visibility WHERE id = p_id AND holder = p_worker
        AND held_until > now AND state IN ('queued', 'running') AND expires_at > now;
    RETURN FOUND;
END
$$;

CREATE FUNCTION move_job(
    p_id text, p_expect text[], p_state text, p_worker text, p_attempts integer,
    p_sent boolean, p_error bytea, p_due float8, p_spent boolean, p_now float8
) RETURNS SETOF jobs LANGUAGE plpgsql AS $$
DECLARE
    now float8 := clock(p_now);
    held boolean := p_state = 'running';  -- held by nobody but while RUNNING
    j jobs;
BEGIN
    UPDATE jobs SET state = p_state, attempts = coalesce(p_attempts, attempts),
            sent = coalesce(p_sent, sent), error = coalesce(p_error, error), updated_at = now,
            expires_at = now + keep, seq = seq + 1,
            due = CASE WHEN p_state = 'queued' THEN now + p_due ELSE due END,
            holder = CASE WHEN held THEN holder ELSE '' END,
            held_until = CASE WHEN held THEN held_until ELSE 0 END,
            request = CASE WHEN p_spent THEN ''::bytea ELSE request END
        WHERE id = p_id AND expires_at > now AND state = ANY (p_expect)
            AND (p_worker IS NULL OR (holder = p_worker AND held_until > now))
        RETURNING * INTO j;
    IF FOUND THEN
        RETURN NEXT job_event(j);
    END IF;
END
$$;

CREATE FUNCTION list_jobs(p_state text, p_cursor text, p_count integer, p_now float8)
RETURNS SETOF jobs LANGUAGE sql STABLE AS $$
    SELECT id, route, principal, slot, name, label, ''::bytea, keep, state, attempts, sent,
            error, created_at, updated_at, due, seq, holder, held_until, expires_at
        FROM jobs WHERE id > p_cursor AND expires_at > clock(p_now)
            AND (p_state IS NULL OR state = p_state)
        ORDER BY id LIMIT p_count
$$;

-- Every function finds its tables in this schema, whatever the caller's search_path.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
            WHERE p.pronamespace = current_schema()::regnamespace LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I', f, current_schema());
    END LOOP;
END
$$;
