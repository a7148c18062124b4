"""The client side: ContextCaching, the Ems singleton, transports and copy paths."""
