"""The compiler: from a traced step to a verified per-group Program."""
