"""Which machines, at what price: the catalog of instance types and prices, the optimizer that ranks offers, and the launch failover and cost ledger that use them."""
