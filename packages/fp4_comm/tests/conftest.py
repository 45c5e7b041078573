import pytest
from fp4_comm_cluster import Cluster

# One cluster for the session: four gloo ranks, with communicators over all four, over ranks
# 0-2 and over ranks 0-1 (even and uneven world sizes, subgroups, one cluster to start).
WORLD = 4


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(WORLD, sizes=(4, 3, 2))
    yield c
    c.close()
