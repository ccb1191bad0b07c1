"""flowerapp: A Flower / PyTorch app."""

from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fedpriv.algorithms.deep.problem import capped
from fedpriv.data.partition import partition
from fedpriv.data.sources import load_source

CLASSES_PER_USER = 5  # S: each user holds 5 of the 10 classes (label skew)
MAX_ROWS_PER_USER = 1000  # as fedpriv's max-rows-per-user (only small populations reach it)


class Net(nn.Module):
    """Model (an MLP 784-256-128-10, fedpriv's default `mlp` for Fashion-MNIST): the body
    fc1, fc2 and the head fc3."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """What the head reads: the body's output."""
        x = torch.flatten(x, 1)
        return F.relu(self.fc2(F.relu(self.fc1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.features(x))


@lru_cache(maxsize=2)
def _users(num_partitions: int, seed: int):
    """Fashion-MNIST (Debian's IDX files, normalized) and its label-skew partition into
    ``num_partitions`` users: fedpriv's own functions, so that user i holds exactly the rows
    fedpriv's deep algorithms give user i (training rows: flwr-datasets'
    PathologicalPartitioner, draw for draw; test rows: the user's classes in proportion)."""
    source = load_source("fashion-mnist")
    users = partition(source, "label-skew", num_partitions, seed, CLASSES_PER_USER)
    keys = np.arange(num_partitions)
    train = capped(users.train, MAX_ROWS_PER_USER, keys, seed)
    test = capped(users.test, MAX_ROWS_PER_USER, keys, seed)
    return source, train, test


def load_data(partition_id: int, num_partitions: int, batch_size: int, seed: int = 0):
    """Load the Fashion-MNIST rows of one user (one node = one user)."""
    source, train, test = _users(num_partitions, seed)

    def dataset(rows, x, y) -> TensorDataset:
        mine = rows.rows[rows.offsets[partition_id]:rows.offsets[partition_id + 1]]
        return TensorDataset(torch.from_numpy(x[mine]), torch.from_numpy(y[mine]))

    trainset = dataset(train, source.x_train, source.y_train)
    testset = dataset(test, source.x_test, source.y_test)
    trainloader = DataLoader(trainset, batch_size=batch_size, shuffle=True)
    testloader = DataLoader(testset, batch_size=batch_size)
    return trainloader, testloader


def train(net, trainloader, steps, lr, device):
    """Train the model for ``steps`` SGD steps on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    running_loss, done = 0.0, 0
    while done < steps:
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            done += 1
            if done == steps:
                break
    return running_loss / max(steps, 1)


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    rows = max(len(testloader.dataset), 1)
    return loss / rows, correct / rows
