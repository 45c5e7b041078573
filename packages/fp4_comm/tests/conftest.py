import pytest
from fp4_comm_cluster import Cluster

# One cluster for the session: three gloo ranks, with communicators over all three and over
# ranks 0-1 (uneven and even world sizes, a subgroup, without paying for a second cluster).
WORLD = 3


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(WORLD, sizes=(3, 2))
    yield c
    c.close()
