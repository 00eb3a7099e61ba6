"""Reading what the compiler did: graph facts, memory estimates, reports, dumps, bucket advice."""
