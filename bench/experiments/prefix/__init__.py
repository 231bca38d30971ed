"""What a prefix costs a request's first token: computed, hit locally, pulled from another
replica (``pull``), restored from the node store (``store``)."""
