"""Support for the GraphQL tests: the app they serve and helpers (Node client in drive.mjs)."""
