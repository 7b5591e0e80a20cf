-- Schema version 2: a record counts the replays it served (``replays``), counted by the
-- claim that hands its outcome back, in the same statement. Additive: version 1's
-- functions keep their arguments and answers (a replica of version 1 that is still
-- running during a rolling upgrade calls them and works; one that starts refuses the
-- newer schema), and its ``claim`` counts too; a replica of version 2 calls the ``_v2``
-- functions, which answer the count as well.

ALTER TABLE records ADD COLUMN IF NOT EXISTS replays integer NOT NULL DEFAULT 0;

CREATE TYPE record_row_v2 AS (
    slot text, name text, state text, fingerprint text, owner text, ttl float8,
    payload bytea, created_at float8, updated_at float8, replays integer
);

CREATE FUNCTION shown_v2(r records, p_now float8) RETURNS record_row_v2 LANGUAGE sql STABLE AS $$
    SELECT r.slot, r.name, r.state, r.fingerprint, r.owner,
        greatest(CASE WHEN r.state = 'in_progress' THEN r.lease_until ELSE r.expires_at END
            - p_now, 0),
        r.payload, r.created_at, r.updated_at, r.replays
$$;

-- claim_v2: as version 1's claim, and a finished record handed back with the caller's
-- fingerprint (unless ``p_replay`` is false) is a replay served: ``replays`` + 1. A fresh
-- claim starts at 0.
CREATE FUNCTION claim_v2(
    p_slot text, p_name text, p_scope text, p_fingerprint text, p_owner text,
    p_lock_ttl float8, p_result_ttl float8, p_reexecute boolean, p_replay boolean,
    p_now float8
) RETURNS TABLE (
    claimed boolean, previous text, slot text, name text, state text, fingerprint text,
    owner text, ttl float8, payload bytea, created_at float8, updated_at float8,
    replays integer
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    now float8 := clock(p_now);
    r records;
    last_name text;
    served integer;
BEGIN
    PERFORM lock_key('record', p_slot, p_name);
    SELECT * INTO r FROM records WHERE slot = p_slot AND name = p_name AND expires_at > now;
    IF FOUND AND (r.owner <> p_owner OR r.state <> 'in_progress') THEN
        served := CASE WHEN p_replay AND r.fingerprint = p_fingerprint THEN 1 ELSE 0 END;
        IF r.state <> 'in_progress' THEN  -- an outcome: never claimed over
            IF served = 1 THEN
                UPDATE records SET replays = replays + 1
                    WHERE slot = p_slot AND name = p_name RETURNING * INTO r;
            END IF;
            RETURN QUERY SELECT false, NULL::text, s.* FROM shown_v2(r, now) s;
            RETURN;
        END IF;
        IF r.lease_until > now THEN  -- another owner's call, running
            RETURN QUERY SELECT false, NULL::text, s.* FROM shown_v2(r, now) s;
            RETURN;
        END IF;
        IF NOT p_reexecute THEN  -- another owner's lapsed lease: FAILED, outcome unknown
            UPDATE records SET state = 'failed', updated_at = now, replays = replays + served
                WHERE slot = p_slot AND name = p_name RETURNING * INTO r;
            RETURN QUERY SELECT false, NULL::text, s.* FROM shown_v2(r, now) s;
            RETURN;
        END IF;
    END IF;
    INSERT INTO records AS t (slot, name, scope, state, fingerprint, owner, lease_until,
            expires_at, created_at, updated_at, payload, replays)
        VALUES (p_slot, p_name, p_scope, 'in_progress', p_fingerprint, p_owner,
            now + p_lock_ttl, now + p_result_ttl, now, now, '', 0)
        ON CONFLICT (slot, name) DO UPDATE SET scope = excluded.scope, state = excluded.state,
            fingerprint = excluded.fingerprint, owner = excluded.owner,
            lease_until = excluded.lease_until, expires_at = excluded.expires_at,
            created_at = excluded.created_at, updated_at = excluded.updated_at, payload = '',
            replays = 0;
    SELECT l.name INTO last_name FROM last_claims l WHERE l.slot = p_slot AND l.expires_at > now;
    INSERT INTO last_claims (slot, name, expires_at) VALUES (p_slot, p_name, now + p_result_ttl)
        ON CONFLICT (slot) DO UPDATE SET name = excluded.name, expires_at = excluded.expires_at;
    RETURN QUERY SELECT true, CASE WHEN last_name <> p_name THEN last_name END,
        NULL, NULL, NULL, NULL, NULL, NULL::float8, NULL::bytea, NULL::float8, NULL::float8,
        NULL::integer;
END
$$;

-- Version 1's claim, for its replicas still running: the same answer, counted as above.
CREATE OR REPLACE FUNCTION claim(
    p_slot text, p_name text, p_scope text, p_fingerprint text, p_owner text,
    p_lock_ttl float8, p_result_ttl float8, p_reexecute boolean, p_now float8
) RETURNS TABLE (
    claimed boolean, previous text, slot text, name text, state text, fingerprint text,
    owner text, ttl float8, payload bytea, created_at float8, updated_at float8
) LANGUAGE sql AS $$
    SELECT c.claimed, c.previous, c.slot, c.name, c.state, c.fingerprint, c.owner, c.ttl,
        c.payload, c.created_at, c.updated_at
    FROM claim_v2(p_slot, p_name, p_scope, p_fingerprint, p_owner, p_lock_ttl,
        p_result_ttl, p_reexecute, true, p_now) c
$$;

CREATE FUNCTION get_v2(p_slot text, p_name text, p_now float8) RETURNS SETOF record_row_v2
LANGUAGE sql STABLE AS $$
    SELECT s.* FROM records r, LATERAL shown_v2(r, clock(p_now)) s
        WHERE r.slot = p_slot AND r.name = p_name AND r.expires_at > clock(p_now)
$$;

CREATE FUNCTION scope_records_v2(p_scope text, p_now float8) RETURNS SETOF record_row_v2
LANGUAGE sql STABLE AS $$
    SELECT s.* FROM records r, LATERAL shown_v2(r, clock(p_now)) s
        WHERE r.scope = p_scope AND r.expires_at > clock(p_now)
        ORDER BY r.created_at, r.slot, r.name
$$;

CREATE FUNCTION scan_v2(p_slot text, p_name text, p_count integer, p_now float8)
RETURNS TABLE (
    live boolean, slot text, name text, state text, fingerprint text, owner text, ttl float8,
    payload bytea, created_at float8, updated_at float8, replays integer
) LANGUAGE sql STABLE AS $$
    SELECT r.expires_at > clock(p_now), s.* FROM records r, LATERAL shown_v2(r, clock(p_now)) s
        WHERE (r.slot, r.name) > (p_slot, p_name) ORDER BY r.slot, r.name LIMIT p_count
$$;

-- Every function finds its tables in this schema, whatever the caller's search_path (the
-- new ones, and ``claim``, whose replacement dropped its setting).
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
