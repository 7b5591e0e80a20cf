-- Schema version 3: a resource's version answers whether a write's mark is there
-- (``v_writing``: a write through the proxy is in flight, or one whose settle never came),
-- so that a reader keyed on the number (the response cache) can tell it is not to be
-- trusted. No table changes: the mark is version 1's ``resource_versions.pending``.
-- Additive, as version 2: version 1's ``version_op`` keeps its arguments and answers (a
-- replica of an earlier version that is still running during a rolling upgrade calls it
-- and works; one that starts refuses the newer schema); a replica of version 3 calls
-- ``version_op_v3``, which answers the mark as well.

-- version_op_v3: as version 1's version_op, and whether a mark is there after it: true
-- after a 'begin' (the caller's), false after a 'settle', and a 'read' tells whether any
-- owner's mark is left.
CREATE FUNCTION version_op_v3(
    p_op text, p_scope text, p_key text, p_owner text, p_wrote boolean, p_ttl float8,
    p_start bigint, p_now float8
) RETURNS TABLE (v_number bigint, v_written boolean, v_writing boolean)
LANGUAGE plpgsql AS $$
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
    RETURN QUERY SELECT v.n, v.written, v.pending <> '';
END
$$;

-- Version 1's version_op, for the replicas of earlier versions still running: the same
-- arguments and answer, from the one body above.
CREATE OR REPLACE FUNCTION version_op(
    p_op text, p_scope text, p_key text, p_owner text, p_wrote boolean, p_ttl float8,
    p_start bigint, p_now float8
) RETURNS TABLE (v_number bigint, v_written boolean) LANGUAGE sql AS $$
    SELECT o.v_number, o.v_written
    FROM version_op_v3(p_op, p_scope, p_key, p_owner, p_wrote, p_ttl, p_start, p_now) o
$$;

-- Every function finds its tables in this schema, whatever the caller's search_path (the
-- new one, and ``version_op``, whose replacement dropped its setting).
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
