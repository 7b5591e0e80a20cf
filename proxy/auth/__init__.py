"""Who is calling: bearer JWTs from trusted issuers, and the principal they make."""
