"""The batching engine: requests in flight decoded together, each row restoring its own stored prefix, exactly."""
