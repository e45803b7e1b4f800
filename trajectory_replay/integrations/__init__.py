"""Framework integrations, imported only when used."""
