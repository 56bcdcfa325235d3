"""Wire protocols: thin translators between HTTP and the runtime's AG-UI events."""
